"""A request that repeats a whole cached prompt samples from the logits kept after it: it
computes nothing, and its output is the one it would have computed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import VOCAB, fake_logits, make_req, scheduler

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import GenerateRequest, SamplingParams
from runtime.verify import apply_logits

PROMPT = [1, 4093, 314, 260, 3575, 282, 4649, 314]
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
COUNTERS = (
    "prefill_tokens_total",
    "cached_tokens_total",
    "forward_passes_total",
    "prompt_logits_reused_total",
)


@pytest.fixture
def engine(tiny_model_dir, engine_steps_checked):
    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)) as eng:
        yield eng


def counted(eng: Engine, requests: list[GenerateRequest]) -> tuple[list, dict[str, float]]:
    """Outputs of `requests` submitted together, and the counters they moved."""
    before = eng.stats()
    results = [h.result() for h in eng.submit_many(requests)]
    after = eng.stats()
    return [r.output_ids for r in results], {k: after[k] - before[k] for k in COUNTERS}


def test_a_repeated_prompt_prefills_nothing_and_decodes_the_same(engine):
    (first,), cold = counted(engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY)])
    (again,), warm = counted(engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY)])
    assert again == first
    assert cold["prefill_tokens_total"] == len(PROMPT) and cold["prompt_logits_reused_total"] == 0
    assert warm["prefill_tokens_total"] == 0 and warm["cached_tokens_total"] == len(PROMPT)
    assert warm["prompt_logits_reused_total"] == 1
    assert warm["forward_passes_total"] == cold["forward_passes_total"] - 1  # no prefill pass


def test_n_siblings_sample_as_without_reuse_and_prefill_the_prompt_once(tiny_model_dir, engine):
    siblings = [
        GenerateRequest(
            input_ids=PROMPT,
            sampling=SamplingParams(temperature=0.9, seed=seed, max_new_tokens=6, logprobs=True),
        )
        for seed in range(4)
    ]
    outputs, moved = counted(engine, siblings)
    assert moved["prefill_tokens_total"] == len(PROMPT)  # the last token too, once
    assert moved["prompt_logits_reused_total"] == 3
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096, reuse_prompt_logits=0)
    with Engine(config) as plain:
        expected, computed = counted(plain, siblings)
    assert outputs == expected  # seeded draws from the same rows
    assert computed["prefill_tokens_total"] == len(PROMPT) + 3
    assert computed["prompt_logits_reused_total"] == 0
    assert len({tuple(o) for o in outputs}) > 1  # the seeds did sample differently


def test_branches_that_gen_right_after_their_pinned_prefix_compute_nothing(engine):
    before = engine.stats()
    with engine.pin(PROMPT):
        outputs, moved = counted(
            engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY) for _ in range(3)]
        )
    assert moved["prefill_tokens_total"] == 0 and moved["prompt_logits_reused_total"] == 3
    assert engine.stats()["prefill_tokens_total"] - before["prefill_tokens_total"] == len(PROMPT)
    engine.flush_cache()
    (expected,), _ = counted(engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY)])
    assert outputs == [expected] * 3


def test_no_reuse_across_namespaces_after_eviction_or_with_prompt_logprobs(engine):
    (first,), _ = counted(engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY)])
    other = GenerateRequest(input_ids=PROMPT, sampling=GREEDY, namespace="tenant-b")
    (out,), moved = counted(engine, [other])
    assert out == first and moved["prefill_tokens_total"] == len(PROMPT)
    assert moved["prompt_logits_reused_total"] == 0

    engine.flush_cache()  # the row is kept, the KV is not: the request computes its prompt
    (out,), moved = counted(engine, [GenerateRequest(input_ids=PROMPT, sampling=GREEDY)])
    assert out == first and moved["prefill_tokens_total"] == len(PROMPT)
    assert moved["prompt_logits_reused_total"] == 0

    logprobs = GREEDY.model_copy(update={"prompt_logprobs": True, "logprob_start_len": 1})
    request = GenerateRequest(input_ids=PROMPT, sampling=logprobs)
    (result,) = engine.generate(request)
    assert result.output_ids == first
    assert all(lp is not None for lp in result.prompt_logprobs[1:])
    assert engine.stats()["prompt_logits_reused_total"] == 0


def test_without_a_prefix_cache_nothing_is_kept(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096, disable_radix_cache=True)
    with Engine(config) as eng:
        for _ in range(2):
            eng.generate(GenerateRequest(input_ids=PROMPT, sampling=GREEDY))
        stats = eng.stats()
    assert stats["prompt_logits_rows"] == 0 and stats["prompt_logits_reused_total"] == 0
    assert stats["prefill_tokens_total"] == 2 * len(PROMPT)


# ------------------------------------------------------------- the scheduler, a fake model
def run_all(sched, reqs) -> dict[str, list[int]]:
    """Requests arriving in waves (a list of lists); each wave runs to the end, invariants
    checked after every step. Outputs by request id."""
    done = {}
    for wave in reqs:
        for req in wave:
            sched.add(req)
        while sched.has_work():
            batch = sched.schedule()
            assert batch is not None
            if batch.forward is None:  # every entry reuses a kept row
                assert all(e.reuses_logits for e in batch.entries)
            sched.process(batch, apply_logits(batch, fake_logits(batch), True))
            sched.check_integrity()
        done.update({r.rid: list(r.gen.output_ids) for r in wave})
    return done


PROMPTS = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12)
WAVES = st.lists(
    st.lists(st.tuples(st.integers(0, 3), st.sampled_from([None, "a"])), min_size=1, max_size=6),
    min_size=1,
    max_size=5,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=st.lists(PROMPTS, min_size=4, max_size=4), waves=WAVES, rows=st.integers(0, 3))
def test_reuse_never_changes_an_output_and_never_computes_more(prompts, waves, rows):
    def requests():
        made = []
        for w, wave in enumerate(waves):
            made.append([])
            for i, (p, namespace) in enumerate(wave):
                req = make_req(f"{w}.{i}", prompts[p], max_new_tokens=3)
                req.namespace = namespace
                made[-1].append(req)
        return made

    on, off = scheduler(reuse_prompt_logits=rows), scheduler(reuse_prompt_logits=0)
    assert run_all(on, requests()) == run_all(off, requests())
    reused = on.prompt_logits.num_reused
    assert on.counters["prefill_tokens"] + reused == off.counters["prefill_tokens"]
    assert on.stats()["prompt_logits_rows"] <= rows


def test_the_least_recently_used_row_goes_first():
    sched = scheduler(reuse_prompt_logits=2)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    run_all(sched, [[make_req(f"p{i}", p)] for i, p in enumerate(prompts)])
    assert sched.stats()["prompt_logits_rows"] == 2
    again = [[make_req(f"again{i}", p)] for i, p in enumerate(prompts)]
    run_all(sched, again[1:])  # the two kept
    assert sched.prompt_logits.num_reused == 2
    computed = sched.counters["prefill_tokens"]
    run_all(sched, again[:1])  # dropped: computes its last token again (and is kept)
    assert sched.prompt_logits.num_reused == 2
    assert sched.counters["prefill_tokens"] == computed + 1
    assert sched.stats()["prompt_logits_rows"] == 2
