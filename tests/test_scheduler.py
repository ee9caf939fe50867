"""The scheduler alone, with no model: fake logits drive admission, prefill-once waits,
retraction, policies and pins. Invariants are checked after every step."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.generation import GenerationState
from runtime.prefix import union_prefix_tokens
from runtime.protocol import GraphHints, SamplingParams
from runtime.scheduler.request import Req, ReqKind, ReqStatus
from runtime.scheduler.scheduler import ScheduledBatch, Scheduler
from runtime.verify import apply_logits

VOCAB = 97


def fake_logits(batch: ScheduledBatch) -> torch.Tensor | None:
    """The "model" predicts (input token + 1) % VOCAB: outputs depend on tokens only."""
    fwd = batch.forward
    if fwd is None:
        return None  # every entry samples from kept prompt logits
    nxt = (fwd.input_ids[fwd.logit_rows] + 1) % VOCAB
    return torch.nn.functional.one_hot(nxt, VOCAB).float() * 10  # (num_logit_rows, vocab)


def make_req(
    rid: str,
    ids: list[int],
    max_new_tokens: int = 4,
    kind: ReqKind = ReqKind.GENERATE,
    arrival: int = 0,
) -> Req:
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    gen = GenerationState(params, ids, None, (), VOCAB)
    return Req(rid, ids, gen, kind, None, GraphHints(), arrival)


def scheduler(num_slots: int = 4096, **settings) -> Scheduler:
    return Scheduler(EngineConfig(**settings), num_slots)


def run(sched: Scheduler, max_steps: int = 10_000) -> int:
    """Step until idle, checking invariants after every step; return the number of steps."""
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None, "work left but nothing schedulable"
        sched.process(batch, apply_logits(batch, fake_logits(batch), True))
        sched.check_integrity()
        steps += 1
        assert steps < max_steps
    return steps


def expected_output(ids: list[int], n: int) -> list[int]:
    out, last = [], ids[-1]
    for _ in range(n):
        last = (last + 1) % VOCAB
        out.append(last)
    return out


def shared_prompts(num: int, prefix_len: int = 40, tail_len: int = 5) -> list[list[int]]:
    prefix = [(3 * i) % VOCAB for i in range(prefix_len)]
    return [prefix + [(50 + 7 * r + j) % VOCAB for j in range(tail_len)] for r in range(num)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_cold_batch_computes_its_union_prefix_tree_once(page_size):
    sched = scheduler(page_size=page_size, chunked_prefill_tokens=16)
    prompts = shared_prompts(6)
    reqs = [make_req(f"r{i}", p, arrival=i) for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add(req)
    run(sched)
    union = union_prefix_tokens(prompts)
    computed = sched.counters["prefill_tokens"]
    divergences = len(prompts) - 1
    assert union <= computed <= union + divergences * (page_size - 1)
    assert sched.counters["prefill_waits"] > 0, "siblings waited for the shared prefix"
    assert computed + sched.counters["cached_tokens"] == sum(map(len, prompts))
    for req in reqs:
        assert req.gen.output_ids == expected_output(req.prompt_ids, 4)
        assert req.status is ReqStatus.FINISHED


def test_without_a_cache_every_request_computes_its_whole_prompt():
    sched = scheduler(disable_radix_cache=True, chunked_prefill_tokens=16)
    prompts = shared_prompts(4)
    reqs = [make_req(f"r{i}", p, arrival=i) for i, p in enumerate(prompts)]
    for req in reqs:
        sched.add(req)
    run(sched)
    assert sched.counters["prefill_tokens"] == sum(map(len, prompts))
    assert sched.counters["cached_tokens"] == sched.counters["prefill_waits"] == 0
    assert sched.kv.allocator.num_free_slots == sched.kv.allocator.num_slots
    assert all(r.gen.output_ids == expected_output(r.prompt_ids, 4) for r in reqs)


def test_memory_pressure_retracts_and_every_request_still_finishes_right():
    prompts = [[(11 * r + j) % VOCAB for j in range(12)] for r in range(6)]
    outputs = {}
    for num_slots in (4096, 48):  # roomy, then too small for all six at once
        sched = scheduler(num_slots=num_slots)
        reqs = [make_req(f"r{i}", p, max_new_tokens=20, arrival=i) for i, p in enumerate(prompts)]
        for req in reqs:
            sched.add(req)
        run(sched)
        outputs[num_slots] = [r.gen.output_ids for r in reqs]
        if num_slots == 48:
            assert sched.counters["retractions"] > 0
            assert sched.kv.cache.num_evicted_tokens > 0
    assert outputs[48] == outputs[4096]


def test_a_request_that_can_never_fit_fails_alone():
    sched = scheduler(num_slots=32)
    big = make_req("big", list(range(40)), arrival=0)
    small = make_req("small", [1, 2, 3], arrival=1)
    sched.add(big)
    sched.add(small)
    run(sched)
    assert big.gen.finish_reason == "error" and "raise max_kv_tokens" in big.error
    assert small.gen.finish_reason == "length" and small.gen.output_ids == [4, 5, 6, 7]


@pytest.mark.parametrize("eviction_policy", ["lru", "graph"])
def test_a_cached_prefix_is_not_promised_twice_and_nothing_stalls_behind_it(eviction_policy):
    """A request whose cached prefix is unlocked would be promised those slots twice: once as
    its prefix, once as evictable room for its new tokens. Beside a pin holding half the pool
    it cannot fit; it fails as busy at once, and the request behind it runs (a pass that
    admitted it, then found no slots for its first chunk, ended there every step: a stall
    found with agents under run_batch's pins)."""
    sched = scheduler(num_slots=200, eviction_policy=eviction_policy)
    pin = make_req("pin", [1 + i % 50 for i in range(100)], max_new_tokens=0, kind=ReqKind.PIN)
    sched.add(pin)
    run(sched)
    context = [60 + i % 30 for i in range(56)]
    sched.add(make_req("first", context, arrival=1))
    run(sched)  # its 56 + 3 tokens stay cached, unlocked
    assert sched.kv.cache.protected_size == 100 and sched.kv.cache.evictable_size >= 56
    grows = make_req("grows", context + [90 + i % 7 for i in range(50)], arrival=2)
    fresh = [100 + i % 20 for i in range(20)]
    behind = make_req("behind", fresh, arrival=3)
    sched.add(grows)
    sched.add(behind)
    run(sched)
    assert grows.error_kind == "busy" and "retry later" in grows.error
    assert behind.gen.finish_reason == "length"
    assert behind.gen.output_ids == expected_output(fresh, 4)


def test_lpm_admits_the_longest_cached_match_first():
    sched = scheduler(schedule_policy="lpm", max_running_requests=1)
    warm = [5] * 30
    sched.add(make_req("warm", warm + [1], max_new_tokens=1))
    run(sched)
    cold = make_req("cold", [9] * 30 + [1], max_new_tokens=1, arrival=1)
    hot = make_req("hot", warm + [2], max_new_tokens=1, arrival=2)
    sched.add(cold)
    sched.add(hot)
    run(sched)
    assert hot.queue.admit_seq < cold.queue.admit_seq, "the request with a cached prefix goes first"
    assert hot.usage.cached_tokens == 30 and cold.usage.cached_tokens == 0


def test_dfs_weight_admits_requests_sharing_a_prefix_together_heaviest_first():
    sched = scheduler(schedule_policy="dfs-weight")
    a, b = [5] * 30, [9] * 30
    for i, prefix in enumerate((a, b)):
        sched.add(make_req(f"warm{i}", prefix + [1], max_new_tokens=1, arrival=i))
    run(sched)
    names = ["b1", "a1", "b2", "a2", "a3"]
    reqs = [
        make_req(n, (a if n[0] == "a" else b) + [i + 2], max_new_tokens=1, arrival=10 + i)
        for i, n in enumerate(names)
    ]
    for req in reqs:
        sched.add(req)
    run(sched)  # all five are admitted in one step, in the policy's order
    order = [r.rid for r in sorted(reqs, key=lambda r: r.queue.admit_seq)]
    assert order == ["a1", "a2", "a3", "b1", "b2"]


def test_fcfs_admits_in_arrival_order():
    sched = scheduler(max_running_requests=1)
    reqs = [make_req(f"r{i}", [i + 1] * 8, max_new_tokens=2, arrival=i) for i in (2, 0, 1)]
    for req in reqs:
        sched.add(req)
    run(sched)
    assert sorted(reqs, key=lambda r: r.queue.admit_seq) == sorted(reqs, key=lambda r: r.arrival)


def test_admission_reuses_the_policy_match():
    sched = scheduler(schedule_policy="lpm")
    sched.add(make_req("warm", [7] * 20 + [1], max_new_tokens=1))
    run(sched)
    reqs = [make_req(f"r{i}", [7] * 20 + [i + 2], max_new_tokens=1, arrival=i) for i in range(5)]
    for req in reqs:
        sched.add(req)
    before = sched.policy.num_rematches
    walks = []
    real_match = sched.kv.cache.match_prefix
    sched.kv.cache.match_prefix = lambda *a, **k: walks.append(1) or real_match(*a, **k)
    batch = sched.schedule()
    assert {e.req.rid for e in batch.entries} == {r.rid for r in reqs}
    # every walk is the policy's (admission adds none); a request re-matches only when an
    # earlier admission's lock split the edge its match ends in
    assert len(walks) == sched.policy.num_rematches - before < 2 * len(reqs)


def test_a_pin_keeps_its_prefix_and_a_reader_computes_only_its_tail():
    sched = scheduler(num_slots=256)
    prefix = list(range(1, 41))
    pin = make_req("pin", prefix, max_new_tokens=0, kind=ReqKind.PIN)
    sched.add(pin)
    run(sched)
    assert pin.status is ReqStatus.PINNED and "pin" in sched.pins
    assert sched.kv.cache.protected_size == 40
    sched.kv.flush()
    assert sched.kv.cache.total_size == 40, "a pinned prefix is never evicted"
    before = sched.counters["prefill_tokens"]
    reader = make_req("reader", prefix + [60, 61], max_new_tokens=1, arrival=1)
    sched.add(reader)
    run(sched)
    assert sched.counters["prefill_tokens"] - before == 2
    assert sched.abort("pin") and sched.kv.cache.protected_size == 0
    sched.check_integrity()


def test_abort_frees_everything_in_every_state():
    sched = scheduler(max_running_requests=1, chunked_prefill_tokens=16)
    running = make_req("running", list(range(1, 60)), max_new_tokens=8)
    waiting = make_req("waiting", list(range(2, 60)), max_new_tokens=8, arrival=1)
    sched.add(running)
    sched.add(waiting)
    batch = sched.schedule()
    sched.process(batch, apply_logits(batch, fake_logits(batch), True))
    assert running in sched.running and "waiting" in sched.waiting
    assert sched.abort("running") and sched.abort("waiting") and not sched.abort("nobody")
    assert running.gen.finish_reason == waiting.gen.finish_reason == "abort"
    sched.check_integrity()
    assert sched.kv.cache.protected_size == 0
    assert sched.kv.allocator.num_used_slots == sched.kv.cache.total_size


def test_an_expected_output_length_reserves_that_much_growth_not_a_share_of_max_new_tokens():
    """Dynamo's `osl` / hints.expected_output_tokens: admission reserves the estimate for a
    request's growth, so requests with long limits but short expected answers run together
    (without it each reserves a share of max_new_tokens and they start one at a time)."""

    def admitted_at_once(hints: GraphHints) -> int:
        sched = scheduler(num_slots=2048)
        for i in range(4):
            ids = [i + 1] * 100
            params = SamplingParams(temperature=0, max_new_tokens=1500, ignore_eos=True)
            gen = GenerationState(params, ids, None, (), VOCAB)
            sched.add(Req(f"r{i}", ids, gen, ReqKind.GENERATE, None, hints, i))
        sched.schedule()
        return len(sched.running)

    assert admitted_at_once(GraphHints(expected_output_tokens=50)) == 4
    assert admitted_at_once(GraphHints()) < 4
