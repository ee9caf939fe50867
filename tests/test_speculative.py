"""Speculative decoding from the radix tree: the token index beside the tree, drafts, and
verification that leaves outputs exactly as they are without it (greedy token for token,
seeded sampling draw for draw, unseeded sampling in distribution), with invariants checked
after every step."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache
from runtime.cache.token_index import TokenIndex
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.generation import GenerationState
from runtime.model.batch import ForwardBatch
from runtime.protocol import Constraint, GenerateRequest, GraphHints, SamplingParams
from runtime.scheduler.request import Req, ReqKind
from runtime.scheduler.scheduler import ScheduledBatch, Scheduler
from runtime.verify import apply_logits

VOCAB = 11
# engine tests: invariants checked every step; drafts sized by acceptance alone, since the
# measured step costs (wall-clock) would make the counters asserted here depend on load
pytestmark = pytest.mark.usefixtures("engine_steps_checked", "step_costs_unmeasured")


@pytest.fixture
def step_costs_unmeasured(monkeypatch):
    monkeypatch.setattr(Scheduler, "observe_step", lambda self, batch, seconds: None)


# ---------------------------------------------------------------- the token index
def indexed_cache(num_slots: int, page_size: int) -> tuple[RadixCache, TokenIndex]:
    index = TokenIndex(num_slots)
    return RadixCache(SlotAllocator(num_slots, page_size), page_size, listeners=(index,)), index


def insert(cache: RadixCache, ids: list[int], namespace) -> None:
    """Insert like a request releasing its KV: the tree keeps new pages, the rest is freed."""
    aligned = len(ids) // cache.page_size * cache.page_size
    if not aligned or cache.allocator.num_free_slots < aligned:
        return
    slots = cache.allocator.alloc(aligned)
    done = cache.insert(ids[:aligned], slots, namespace)
    if done.prefix_len:
        cache.allocator.free(slots[: done.prefix_len])


def paths(cache: RadixCache, namespace) -> list[tuple[int, ...]]:
    out = []
    for leaf in cache.leaves():
        ns, path, _ = cache.path_of(leaf)
        if ns == namespace:
            out.append(tuple(path))
    return out


def occurs(needle: list[int], haystacks: list[tuple[int, ...]]) -> bool:
    n = len(needle)
    return any(list(hay[i : i + n]) == needle for hay in haystacks for i in range(len(hay) - n + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert", "evict", "query"]),
            st.sampled_from(["a", "b", None]),
            st.lists(st.integers(0, 5), min_size=3, max_size=40),
            st.integers(1, 60),
        ),
        max_size=40,
    ),
)
def test_the_index_follows_the_tree_and_guesses_only_what_a_namespace_holds(page_size, ops):
    cache, index = indexed_cache(256, page_size)
    for op, namespace, ids, amount in ops:
        if op == "insert":
            insert(cache, ids, namespace)
        elif op == "evict":
            cache.evict(amount)
        else:
            matched, guess = index.continuation(namespace, ids, 8)
            if guess:  # what it guesses is a real continuation of the context in this namespace
                assert 3 <= matched <= len(ids)
                assert occurs(ids[len(ids) - matched :] + guess, paths(cache, namespace))
            # every guess is one too, and the best is among them
            every = index.guesses(namespace, ids, 8, limit=64)
            for m, g in every:
                assert 3 <= m <= len(ids)
                assert occurs(ids[len(ids) - m :] + g, paths(cache, namespace))
            best = max(every, key=lambda mg: (mg[0], len(mg[1])), default=(0, []))
            assert (matched, guess) == best
        cache.check_integrity(num_caller_slots=0)


def test_a_guess_never_crosses_namespaces_and_dies_with_eviction():
    cache, index = indexed_cache(64, 1)
    secret = [7, 8, 9, 1, 2, 3, 4, 5]
    insert(cache, secret, "tenant-a")
    assert index.continuation("tenant-a", [7, 8, 9], 4) == (3, [1, 2, 3, 4])
    assert index.continuation("tenant-b", [7, 8, 9], 4) == (0, [])
    assert index.continuation(None, [7, 8, 9], 4) == (0, [])
    cache.evict(64)
    assert index.continuation("tenant-a", [7, 8, 9], 4) == (0, [])
    insert(cache, [7, 8, 9, 6, 6], "tenant-b")  # the freed slots are reused by another tenant
    assert index.continuation("tenant-a", [7, 8, 9], 4) == (0, [])
    assert index.continuation("tenant-b", [7, 8, 9], 4) == (3, [6, 6])
    cache.check_integrity(num_caller_slots=0)


def test_the_longest_matching_context_wins():
    cache, index = indexed_cache(64, 1)
    insert(cache, [1, 5, 6, 7, 10, 11], None)
    insert(cache, [2, 5, 6, 7, 20, 21], None)  # the most recent, but a shorter match
    assert index.continuation(None, [9, 1, 5, 6, 7], 2) == (4, [10, 11])
    assert index.continuation(None, [9, 5, 6, 7], 2) == (3, [20, 21])
    # a token tree's candidates: every matching position, the most recent first
    assert index.guesses(None, [9, 1, 5, 6, 7], 2, limit=8) == [
        (3, [20, 21]),
        (4, [10, 11]),
    ]
    assert index.guesses(None, [9, 1, 5, 6, 7], 2, limit=1) == [(3, [20, 21])]


# ---------------------------------------------------------------- scheduler + verify, fake model
def fake_logits(batch: ScheduledBatch, sharp: bool = True) -> torch.Tensor | None:
    """A "model" whose next token depends on the token and its position's parity, so a
    trigram seen at another parity guesses wrong: drafts both hit and miss."""
    fwd = batch.forward
    if fwd is None:
        return None  # every entry samples from kept prompt logits
    tok, pos = fwd.input_ids[fwd.logit_rows], fwd.positions[fwd.logit_rows]
    nxt = (tok * 3 + 1 + (pos % 2) * (tok % 3 == 0)) % VOCAB
    logits = torch.nn.functional.one_hot(nxt, VOCAB).float()  # (rows, vocab)
    if sharp:
        return logits * 10
    # a smooth distribution: the cycle's token is likely, the rest share the remainder
    return logits * 2.0 + torch.linspace(0, 0.5, VOCAB)


def make_req(rid, ids, params, program=None, namespace=None) -> Req:
    gen = GenerationState(params, ids, None, (), VOCAB)
    hints = GraphHints(program_id=program) if program else GraphHints()
    return Req(rid, ids, gen, ReqKind.GENERATE, namespace, hints, 0)


def run(sched: Scheduler, sharp: bool = True, abort_at: dict[int, str] | None = None) -> int:
    steps = 0
    while sched.has_work():
        if abort_at and steps in abort_at:
            sched.abort(abort_at[steps])
            sched.check_integrity()
            if not sched.has_work():
                break
        batch = sched.schedule()
        assert batch is not None
        sched.process(batch, apply_logits(batch, fake_logits(batch, sharp), True))
        sched.check_integrity()
        steps += 1
        assert steps < 5000
    assert sched.kv.allocator.num_used_slots == sched.kv.cache.total_size  # nothing leaked
    return steps


def outputs(prompts, params, *, speculative, abort_at=None, sharp=True, n=512, **settings):
    sched = Scheduler(EngineConfig(speculative=speculative, **settings), n)
    reqs = [
        make_req(f"r{i}", p, params[i] if isinstance(params, list) else params, program="p")
        for i, p in enumerate(prompts)
    ]
    for req in reqs:
        sched.add(req)
    steps = run(sched, sharp, abort_at)
    return [r.gen.output_ids for r in reqs], sched, steps


prompt_strategy = st.lists(st.integers(0, VOCAB - 1), min_size=3, max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(prompt_strategy, min_size=1, max_size=6),
    max_new=st.integers(1, 24),
    page_size=st.sampled_from([1, 4]),
    chunk=st.sampled_from([16, 64]),
    stop_token=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    max_draft=st.integers(1, 8),
)
def test_greedy_output_is_the_same_token_for_token(
    prompts, max_new, page_size, chunk, stop_token, max_draft
):
    params = SamplingParams(
        temperature=0,
        max_new_tokens=max_new,
        ignore_eos=True,
        stop_token_ids=[stop_token] if stop_token is not None else [],
    )
    common = dict(page_size=page_size, chunked_prefill_tokens=chunk)
    plain, _, _ = outputs(prompts, params, speculative="off", **common)
    spec, sched, _ = outputs(
        prompts, params, speculative="tree", spec_max_draft_tokens=max_draft, **common
    )
    assert spec == plain
    stats = sched.stats()
    assert stats["spec_accepted_tokens_total"] <= stats["spec_draft_tokens_total"]


def test_drafts_are_taken_and_save_steps():
    prompts = [[1, 4, 2, 7, 0, 1, 4, 2, 7, 0, 1, 4]]  # it falls into a cycle: guesses mostly hold
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    plain, _, plain_steps = outputs(prompts, params, speculative="off")
    spec, sched, spec_steps = outputs(prompts, params, speculative="tree")
    assert spec == plain
    stats = sched.stats()
    assert stats["spec_accepted_tokens_total"] > 20
    assert stats["spec_mean_accepted_length"] > 3
    assert spec_steps < plain_steps / 2


def test_memory_pressure_and_aborts_keep_the_books():
    """A pool too small for the batch: retractions and aborts mid-draft leak nothing, and
    the requests that finish say what they say without speculation."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    plain, _, _ = outputs(prompts, params, speculative="off", n=48)
    spec, sched, _ = outputs(prompts, params, speculative="tree", n=48)
    stats = sched.stats()
    assert spec == plain
    assert stats["retractions_total"] > 0 and stats["spec_accepted_tokens_total"] > 0
    aborted, sched, _ = outputs(prompts, params, speculative="tree", n=48, abort_at={3: "r1"})
    survivors = [i for i in range(len(prompts)) if i != 1]
    assert [aborted[i] for i in survivors] == [plain[i] for i in survivors]


def test_a_draft_never_comes_from_another_tenant():
    sched = Scheduler(EngineConfig(speculative="tree"), 512)
    secret = [5, 6, 7, 8, 9, 10, 1, 2, 3]
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    sched.add(make_req("a", secret, params, namespace="tenant-a"))
    run(sched)
    theirs = make_req("b", [0, 5, 6, 7], params, namespace="tenant-b")
    assert sched.drafter.draft(theirs, []) == []
    mine = make_req("a2", [0, 5, 6, 7], params, namespace="tenant-a")
    assert sched.drafter.draft(mine, []) == [8]  # capped by max_new_tokens - 1


def test_a_sibling_of_the_same_program_is_a_source():
    sched = Scheduler(EngineConfig(speculative="tree", disable_radix_cache=True), 512)
    params = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True)
    ahead = make_req("ahead", [9, 9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3], params, program="fork")
    behind = make_req("behind", [8, 3, 1, 4], params, program="fork")
    other = make_req("other", [8, 3, 1, 4], params, program="another")
    assert sched.drafter.draft(behind, [ahead, behind]) == [1, 5, 9, 2]
    assert sched.drafter.draft(other, [ahead, other]) == []


@pytest.mark.parametrize("page_size", [1, 4])
def test_seeded_sampling_draws_the_same_tokens(page_size):
    prompts = [[1, 4, 2, 7, 0, 1, 4, 2, 7, 0, 1, 4], [3, 10, 9, 6, 8, 3, 10, 9]]
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=s)
        for s in range(len(prompts))
    ]
    plain, _, _ = outputs(prompts, params, speculative="off", sharp=False, page_size=page_size)
    spec, sched, _ = outputs(prompts, params, speculative="tree", sharp=False, page_size=page_size)
    assert spec == plain
    assert sched.stats()["spec_accepted_tokens_total"] > 0


def test_unseeded_sampling_keeps_the_distribution():
    """Chi-square, two samples: the 2nd..6th output tokens with and without speculation."""
    prompt = [1, 4, 2, 7, 0, 1, 4, 2, 7, 0, 1, 4]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
    counts = {}
    for mode in ("off", "tree"):
        torch.manual_seed(0)
        hist = torch.zeros(5, VOCAB)
        accepted = 0
        for batch in range(8):
            config = EngineConfig(speculative=mode, seed=batch, spec_max_batch=64)
            sched = Scheduler(config, 4096)
            reqs = [make_req(f"r{i}", prompt, params) for i in range(60)]
            for req in reqs:
                sched.add(req)
            run(sched, sharp=False)
            for req in reqs:
                for k, tok in enumerate(req.gen.output_ids[1:6]):
                    hist[k, tok] += 1
            accepted += sched.stats().get("spec_accepted_tokens_total", 0)
        counts[mode] = (hist, accepted)
    assert counts["tree"][1] > 100  # speculation really ran
    a, b = counts["off"][0], counts["tree"][0]
    for k in range(5):
        keep = (a[k] + b[k]) > 0
        x, y = a[k][keep], b[k][keep]
        chi2 = float((((x - y) ** 2) / (x + y)).sum())
        dof = int(keep.sum()) - 1
        # the 0.1% critical value, Wilson-Hilferty
        z = 3.09
        critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < critical, (k, chi2, critical, x.tolist(), y.tolist())


# ---------------------------------------------------------------- the engine, tiny model
def engine_outputs(model_dir, reqs, **settings):
    config = EngineConfig(model=str(model_dir), max_kv_tokens=8192, **settings)
    with Engine(config) as engine:
        results = engine.generate(reqs)
        return results, engine.stats()


def looping_prompts(tokenizer) -> list[list[int]]:
    text = [
        "Copy: the cat sat on the mat. the cat sat on the mat. the cat sat on",
        "List: one two three four, one two three four, one two",
        "Quote the line 'all that glitters is not gold' and then 'all that glitters",
    ]
    return [tokenizer.encode(t) for t in text]


@pytest.mark.parametrize("backend,page_size", [("torch", 1), ("cpu", 1), ("cpu", 4)])
def test_engine_outputs_are_unchanged_with_stops_logprobs_grammars_and_penalties(
    tiny_model_dir, default_tokenizer, backend, page_size
):
    prompts = looping_prompts(default_tokenizer)
    variants = [
        SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=40, stop=[" mat"], logprobs=True),
        SamplingParams(temperature=0, max_new_tokens=24),
        SamplingParams(temperature=0.8, max_new_tokens=32, seed=5, top_k=20, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=32, frequency_penalty=0.3, ignore_eos=True),
    ]
    schema = {"type": "object", "properties": {"cat": {"type": "string"}}, "required": ["cat"]}
    json = Constraint(json_schema=schema)  # masks per draft position, and jump-forward
    reqs = [
        GenerateRequest(input_ids=p, sampling=v, constraint=json if i == 2 else None)
        for p in prompts
        for i, v in enumerate(variants)
    ]
    common = dict(attention_backend=backend, page_size=page_size)
    plain, _ = engine_outputs(tiny_model_dir, reqs, speculative="off", **common)
    spec, stats = engine_outputs(tiny_model_dir, reqs, speculative="tree", **common)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert [r.text for r in spec] == [r.text for r in plain]
    for a, b in zip(plain, spec, strict=True):
        assert a.finish_reason == b.finish_reason
        if a.logprobs:
            assert [t.logprob for t in a.logprobs] == pytest.approx(
                [t.logprob for t in b.logprobs], abs=1e-3
            )
    assert stats["spec_accepted_tokens_total"] > 0


def single_decode(kernels, q_row, k_pool, v_pool, slots, kv_chunk):
    """One query row (H, D) as a plain decode over the keys at `slots`: (out, lse)."""
    keys = len(slots)
    return kernels.paged_attention(
        q_row[None],
        k_pool,
        v_pool,
        slots,
        torch.tensor([0, keys]),
        torch.tensor([0, 1]),
        q_row.shape[-1] ** -0.5,
        0,
        0.0,
        kv_chunk,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_rows", [(64, 5), (128, 9), (64, 16)])
@pytest.mark.parametrize("kv_chunk", [0, 64])
def test_the_native_kernel_verifies_a_draft_as_single_decodes_would(
    dtype, head_dim, num_rows, kv_chunk
):
    """n new rows of one sequence in one call (causal among them) give bit for bit what n
    single-row decodes over the growing prefix give, keys at once or in chunks of 64: a
    verified draft sees exactly the plain decode's attention."""
    from runtime.model.native.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(1)
    kv_len, heads, kv_heads = 301, 9, 3
    k_pool, v_pool = torch.randn(2, 2000, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(num_rows, heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(2000, generator=gen)[:kv_len]
    scale = head_dim**-0.5
    got, lse = kernels.paged_attention(
        q,
        k_pool,
        v_pool,
        slots,
        torch.tensor([0, kv_len]),
        torch.tensor([0, num_rows]),
        scale,
        0,
        0.0,
        kv_chunk,
    )
    for r in range(num_rows):
        visible = kv_len - num_rows + r + 1
        one, one_lse = single_decode(kernels, q[r], k_pool, v_pool, slots[:visible], kv_chunk)
        assert torch.equal(got[r], one[0]), r
        assert torch.equal(lse[r], one_lse[0]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [(1, 4, 7), (2, 2), (16, 1, 9), (3,)])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_several_drafts_in_one_call_are_single_decodes_on_any_thread_count(
    dtype, num_rows, threads
):
    """A few sequences' drafts are split over the threads by KV head and by rows: whatever
    the split (1-4 threads), every row gets bit for bit its single-row decode."""
    from runtime.model.native.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(len(num_rows) + threads)
    heads, kv_heads, head_dim = 9, 3, 64
    k_pool, v_pool = torch.randn(2, 3000, kv_heads, head_dim, generator=gen).to(dtype)
    kv_lens = [150 + 97 * i for i in range(len(num_rows))]
    slots = torch.randperm(3000, generator=gen)[: sum(kv_lens)]
    q = torch.randn(sum(num_rows), heads, head_dim, generator=gen).to(dtype)
    kv_indptr = torch.tensor([0, *itertools.accumulate(kv_lens)])
    qo_indptr = torch.tensor([0, *itertools.accumulate(num_rows)])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, lse = kernels.paged_attention(
            q, k_pool, v_pool, slots, kv_indptr, qo_indptr, head_dim**-0.5, 0, 0.0, 0
        )
    finally:
        torch.set_num_threads(before)
    for b, n in enumerate(num_rows):
        own = slots[kv_indptr[b] : kv_indptr[b + 1]]
        for r in range(n):
            row = int(qo_indptr[b]) + r
            visible = kv_lens[b] - n + r + 1
            one, one_lse = single_decode(kernels, q[row], k_pool, v_pool, own[:visible], 0)
            assert torch.equal(got[row], one[0]), (b, r)
            assert torch.equal(lse[row], one_lse[0]), (b, r)


@pytest.mark.parametrize(
    "kind", ["llama", "qwen3", "phi3", "mixtral", "qwen3-moe", "gemma2", "gemma3"]
)
def test_every_family_decodes_the_same_with_guesses(kind, tmp_path):
    from conftest import tiny_hf_model

    tiny_hf_model(kind, initializer_range=0.1).save_pretrained(tmp_path)
    loop = [(7 * j) % 50 + 5 for j in range(24)]
    reqs = [
        GenerateRequest(
            input_ids=loop * 2 + loop[: 5 + 3 * i],
            sampling=SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
        )
        for i in range(3)
    ]
    plain, _ = engine_outputs(tmp_path, reqs, speculative="off")
    config = EngineConfig(model=str(tmp_path), max_kv_tokens=8192, speculative="tree")
    with Engine(config) as engine:
        first = engine.generate(reqs)
        # asked again: the tree holds the first answers, so whole guesses come from it
        again = engine.generate([r.model_copy(update={"rid": r.rid + "-again"}) for r in reqs])
        stats = engine.stats()
    assert [r.output_ids for r in first] == [r.output_ids for r in plain]
    assert [r.output_ids for r in again] == [r.output_ids for r in plain]
    assert stats["spec_accepted_tokens_total"] >= len(reqs) * 8


def test_step_costs_decide_how_long_a_draft_pays():
    from runtime.scheduler.step_costs import StepCosts

    costs = StepCosts()
    assert costs.worth(1, 0.5, 8) == 8  # nothing measured yet: the request's own length
    for step in range(40):
        drafted = step % 5
        costs.observe(1, drafted, 0.040 + 0.004 * drafted)  # memory-bound: rho = 0.1
        costs.observe(8, drafted * 8, 0.100 + 0.0045 * drafted * 8)  # rho = 0.36
    t0, per_token = costs.fit(1)
    assert t0 == pytest.approx(0.040) and per_token == pytest.approx(0.004)
    assert costs.worth(1, 0.55, 8) == 3  # 0.55^3 > 0.1 > 0.55^4
    assert costs.worth(1, 0.95, 8) == 8
    assert costs.worth(8, 0.55, 8) == 1  # 0.55 > 0.36 > 0.55^2
    assert costs.worth(8, 0.3, 8) == 0
    assert costs.fit(4) is None and costs.pooled_fit(4) is not None  # from sizes 1 and 8


def test_a_batch_size_seen_seldom_takes_the_fit_over_every_size():
    """A fork's batch changes every few steps: sizes without steps of their own are costed by
    seconds = a + c * B + b * D over all sizes, not guessed at full length."""
    from runtime.scheduler.step_costs import StepCosts

    costs = StepCosts()
    for step in range(30):  # one size only: no fit over sizes yet
        costs.observe(3, step % 4, 0.012 + 0.0008 * 3 + 0.001 * (step % 4))
    assert costs.pooled_fit(17) is None and costs.worth(17, 0.6, 6) == 6
    collinear = StepCosts()  # every request guessing 4: D = 4 B leaves the slopes unsolvable
    for step in range(30):
        size = (1, 2, 4)[step % 3]
        collinear.observe(size, 4 * size, 0.01 + 0.001 * size + 0.002 * 4 * size)
    assert collinear.pooled_fit(3) is None
    for step in range(60):
        size = (3, 9, 27)[step % 3]
        drafted = step % 5 * (size < 27)  # the largest size never guesses
        costs.observe(size, drafted, 0.012 + 0.0008 * size + 0.001 * drafted)
    assert costs.fit(17) is None
    t0, per_token = costs.pooled_fit(17)
    assert t0 == pytest.approx(0.012 + 0.0008 * 17) and per_token == pytest.approx(0.001)
    # rho(17) = 17 * 0.001 / 0.0256 = 0.66: one token at alpha 0.7, none at 0.6
    assert costs.worth(17, 0.7, 8) == 1 and costs.worth(17, 0.6, 8) == 0
    # a size with steps of its own keeps its own fit: rho(3) = 0.003 / 0.0144 = 0.21
    assert costs.fit(3) is not None and costs.worth(3, 0.6, 8) == 3


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("members,draft_rows", [(2, 5), (4, 9), (6, 9), (3, 16)])
def test_a_verifying_pass_computes_what_plain_decodes_compute(
    head_dim_64_model_dir, dtype, members, draft_rows
):
    """Sequences behind a shared cached prefix (a cascade, its prefix packed) verify drafts of
    `draft_rows` tokens in one pass: every row's logits equal, bit for bit, what the same tokens
    give fed one decode step at a time. The cascade's fused decode takes the draft's rows, and
    a verifying pass keeps the decode GEMM past its usual row limit (6 x 9 = 54 rows, over
    bf16's 32), so a guess changes no rounding, in bf16 too."""
    from runtime.model.native.kernels import native_flash_supported
    from runtime.model.runner import ModelRunner

    if not native_flash_supported():
        pytest.skip("this CPU lacks AVX-512 BF16: no packed prefixes, no fused decode")
    runner = ModelRunner.from_checkpoint(
        head_dim_64_model_dir, 4096, dtype=dtype, attention_backend="cpu"
    )
    gen = torch.Generator().manual_seed(members * 100 + draft_rows)
    prefix = torch.randint(3, 49152, (100,), generator=gen).tolist()
    suffixes = [
        torch.randint(3, 49152, (7 * b + 3,), generator=gen).tolist() for b in range(members)
    ]
    drafts = [torch.randint(3, 49152, (draft_rows,), generator=gen).tolist() for _ in suffixes]
    free = iter(range(4096))
    prefix_slots = torch.tensor([next(free) for _ in prefix])
    cached = [torch.cat([prefix_slots, torch.tensor([next(free) for _ in s])]) for s in suffixes]
    runner.forward(ForwardBatch.build([prefix], [prefix_slots]))
    runner.forward(ForwardBatch.build(suffixes, cached))

    def new_slots():
        return [torch.tensor([next(free) for _ in range(draft_rows)]) for _ in range(members)]

    attention = runner.attention
    fused_before = attention.fused_decode_passes
    verify_slots = new_slots()
    verified = runner.forward(
        ForwardBatch.build(
            drafts,
            [torch.cat([c, s]) for c, s in zip(cached, verify_slots, strict=True)],
            logit_tails=[draft_rows] * members,
        )
    ).view(members, draft_rows, -1)
    assert attention.fused_decode_passes == fused_before + 1  # the draft took the fused path
    plain_slots = new_slots()
    for r in range(draft_rows):
        step = runner.forward(
            ForwardBatch.build(
                [[d[r]] for d in drafts],
                [torch.cat([c, s[: r + 1]]) for c, s in zip(cached, plain_slots, strict=True)],
            )
        )
        for b in range(members):
            assert torch.equal(verified[b, r], step[b]), (b, r)
    assert attention.fused_decode_passes == fused_before + 1 + draft_rows
