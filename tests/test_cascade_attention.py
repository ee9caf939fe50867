"""Cascade attention (a shared cached prefix attended once for many sequences) vs the reference.

The CPU backend must give the torch reference's results whatever the batch: decodes, short and
long extends behind one shared prefix, prefixes held in one slot run or scattered, sequences
outside any group, several groups. Planning is checked on its own: a group's members really share
its slots, all cached before the step.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.pool import KVPool
from runtime.model.attention.cascade import find_shared_prefixes
from runtime.model.attention.cpu_backend import CpuPagedAttention
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.batch import ForwardBatch
from runtime.model.native.kernels import native_flash_supported

HEADS, KV_HEADS, HEAD_DIM, NUM_SLOTS = 6, 2, 16, 4096


def run_layer(backend_cls, pool: KVPool, batch: ForwardBatch, qkv, layer: int = 0):
    backend = backend_cls(pool, (None,) * pool.num_layers)
    backend.plan(batch)
    return backend, backend.forward(layer, *qkv)


def random_qkv(num_tokens: int, dtype: torch.dtype, gen: torch.Generator, head_dim=HEAD_DIM):
    q = torch.randn(num_tokens, HEADS, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, num_tokens, KV_HEADS, head_dim, generator=gen).to(dtype)
    return q, k, v


def shared_batch(prefix: torch.Tensor, tails: list[tuple[int, int]], gen, free: torch.Tensor):
    """Sequences `prefix + own cached tail + new tokens`; tails are (own_cached, num_new)."""
    slot_lists, new_ids, used = [], [], 0
    for own, num_new in tails:
        own_slots = free[used : used + own + num_new]
        used += own + num_new
        slot_lists.append(torch.cat([prefix, own_slots]))
        new_ids.append(torch.randint(0, 100, (num_new,), generator=gen).tolist())
    return slot_lists, new_ids, free[used:]


def mixed_batch(dtype: torch.dtype, head_dim: int, contiguous: bool):
    """Two groups behind shared prefixes and three loners, over a random pool (layer 1) and its
    copy for the reference: (pool, ref_pool, batch, qkv)."""
    gen = torch.Generator().manual_seed(1)
    pool = KVPool(2, NUM_SLOTS, KV_HEADS, head_dim, dtype)
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(NUM_SLOTS, KV_HEADS, head_dim, generator=gen))
        pool.v[layer].copy_(torch.randn(NUM_SLOTS, KV_HEADS, head_dim, generator=gen))
    order = torch.arange(NUM_SLOTS) if contiguous else torch.randperm(NUM_SLOTS, generator=gen)
    prefix_a, prefix_b, free = order[100:300], order[300:380], order[400:]
    # group A: decodes, a short extend, long extends with and without an own cached tail
    a_slots, a_ids, free = shared_batch(
        prefix_a, [(5, 1), (0, 1), (40, 1), (17, 9), (0, 70), (33, 48)], gen, free
    )
    # group B: two decodes
    b_slots, b_ids, free = shared_batch(prefix_b, [(3, 1), (12, 1)], gen, free)
    # loners: a decode, a fresh prefill, a long extend after its own cached prefix
    lone_slots = [free[:50], free[50:90], free[90:250]]
    lone_ids = [[7], torch.randint(0, 100, (40,), generator=gen).tolist(), [3] * 60]
    batch = ForwardBatch.build(a_ids + b_ids + lone_ids, a_slots + b_slots + lone_slots)
    qkv = random_qkv(batch.num_tokens, dtype, gen, head_dim)
    ref_pool = KVPool(2, NUM_SLOTS, KV_HEADS, head_dim, dtype)
    for layer in range(2):
        ref_pool.k[layer].copy_(pool.k[layer])
        ref_pool.v[layer].copy_(pool.v[layer])
    return pool, ref_pool, batch, qkv


@pytest.mark.parametrize(
    "dtype,head_dim,tol",
    [
        (torch.float32, HEAD_DIM, 1e-5),
        (torch.bfloat16, HEAD_DIM, 3e-2),
        (torch.float32, 64, 1e-5),
        (torch.bfloat16, 64, 3e-2),
    ],
)
@pytest.mark.parametrize("contiguous", [True, False])
def test_cascade_matches_reference(dtype, head_dim, tol, contiguous):
    """head_dim 64 takes the native flash kernel where the CPU has AVX-512 BF16; 16 torch's."""
    pool, ref_pool, batch, qkv = mixed_batch(dtype, head_dim, contiguous)
    backend, got = run_layer(CpuPagedAttention, pool, batch, qkv, layer=1)
    _, expected = run_layer(TorchAttention, ref_pool, batch, qkv, layer=1)
    assert sorted(len(c.prefix.members) for c in backend._cascades) == [1, 2, 6]
    assert sorted(c.prefix.length for c in backend._cascades) == [80, 100, 200]
    assert all((c.prefix.first_slot is not None) == contiguous for c in backend._cascades)
    assert len(backend._extends) == 1 and backend.decode_group is not None  # the other loners
    native = head_dim == 64 and native_flash_supported()
    assert backend._native_flash == native
    assert (got.float() - expected.float()).abs().max().item() < tol
    assert torch.equal(pool.k[1], ref_pool.k[1])  # the new K/V were written alike


@pytest.mark.skipif(not native_flash_supported(), reason="this CPU lacks AVX-512 BF16")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_batch_invariant_cascades_hold_decodes_only_behind_whole_chunks(dtype, tol):
    """Batch-invariant, the same batch: decodes group apart behind whole chunks (A's 200 slots
    cut to 192, B's 80 to 64), every extend past 16 new tokens (A's two long ones, two loners)
    takes flash on its own, and the results are still the reference's."""
    pool, ref_pool, batch, qkv = mixed_batch(dtype, 64, contiguous=False)
    backend = CpuPagedAttention(pool, (None, None), batch_invariant=True)
    backend.plan(batch)
    got = backend.forward(1, *qkv)
    _, expected = run_layer(TorchAttention, ref_pool, batch, qkv, layer=1)
    assert sorted(len(c.prefix.members) for c in backend._cascades) == [2, 4]
    assert sorted(c.prefix.length for c in backend._cascades) == [64, 192]
    assert all(c.fused_decode and c.packed is None for c in backend._cascades)
    assert len(backend._extends) == 4 and backend.decode_group is not None
    assert (got.float() - expected.float()).abs().max().item() < tol


def test_short_shared_prefix_and_windows_stay_per_sequence():
    pool = KVPool(1, 512, KV_HEADS, HEAD_DIM)
    prefix = torch.arange(10)
    slots = [torch.cat([prefix, torch.tensor([100 + i])]) for i in range(3)]
    batch = ForwardBatch.build([[1], [2], [3]], slots)
    backend = CpuPagedAttention(pool, (None,))
    backend.plan(batch)
    assert backend._cascades == []  # 10 shared tokens: below min_shared_tokens
    windowed = CpuPagedAttention(pool, (8,))
    long_slots = [torch.cat([torch.arange(200), torch.tensor([300 + i])]) for i in range(3)]
    windowed.plan(ForwardBatch.build([[1], [2], [3]], long_slots))
    assert windowed._cascades == []


@st.composite
def slot_forest(draw):
    """Sequences grown from a few random trunks: (slot lists, cached prefix lengths)."""
    num_trunks = draw(st.integers(1, 3))
    trunks = [
        list(range(1000 * t, 1000 * t + draw(st.integers(1, 150)))) for t in range(num_trunks)
    ]
    lists, prefix_lens, next_slot = [], [], 10_000
    for _ in range(draw(st.integers(1, 10))):
        trunk = trunks[draw(st.integers(0, num_trunks - 1))]
        keep = draw(st.integers(1, len(trunk)))
        own = draw(st.integers(1, 40))
        slots = trunk[:keep] + list(range(next_slot, next_slot + own))
        next_slot += own
        lists.append(torch.tensor(slots))
        prefix_lens.append(len(slots) - draw(st.integers(1, own)))
    return lists, prefix_lens


@settings(max_examples=200, deadline=None)
@given(slot_forest(), st.integers(1, 80))
def test_groups_share_their_cached_slots(forest, min_tokens):
    lists, prefix_lens = forest
    groups = find_shared_prefixes(lists, prefix_lens, min_tokens)
    seen = set()
    for group in groups:
        assert len(group.members) >= 2 and group.length >= min_tokens
        assert seen.isdisjoint(group.members)
        seen.update(group.members)
        for i in group.members:
            assert group.length <= prefix_lens[i]  # shared part was cached before the step
            assert torch.equal(lists[i][: group.length], group.slots)
        if group.first_slot is not None:
            assert torch.equal(
                group.slots, torch.arange(group.first_slot, group.first_slot + group.length)
            )


def two_rounds(model_dir, backend: str, check=None):
    """W1's first six users behind one system prompt, two turns in rounds, greedy: (outputs,
    prefill tokens computed); `check(engine)` runs before the engine closes."""
    from programs import support_agent
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    config = EngineConfig(model=str(model_dir), attention_backend=backend, max_kv_tokens=30_000)
    with Engine(config) as engine:
        inputs = support_agent.make_inputs(engine.tokenizer, "test")
        prompts = support_agent.first_turn_ids(engine.tokenizer, inputs)[:6]
        sampling = SamplingParams(temperature=0, max_new_tokens=12)
        first = engine.generate([GenerateRequest(input_ids=p, sampling=sampling) for p in prompts])
        follow = [p + r.output_ids + p[-20:] for p, r in zip(prompts, first, strict=True)]
        second = engine.generate([GenerateRequest(input_ids=p, sampling=sampling) for p in follow])
        if check is not None:
            check(engine)
        return [r.output_ids for r in first + second], engine.stats()["prefill_tokens_total"]


def test_engine_outputs_identical_with_cascades(tiny_model_dir):
    """The CPU backend (cascades on) gives the torch reference's greedy tokens and prefill
    counts."""

    def check(engine):
        assert engine.runner.attention.cascade_passes > 0

    assert two_rounds(tiny_model_dir, "cpu", check) == two_rounds(tiny_model_dir, "torch")


@pytest.mark.skipif(not native_flash_supported(), reason="this CPU lacks AVX-512 BF16")
def test_engine_outputs_identical_with_packed_prefixes_and_fused_decodes(head_dim_64_model_dir):
    """At head_dim 64, fp32: cascades pack their shared prefix once per layer and reuse it
    across the decode steps, and the greedy tokens and prefill counts are the torch
    reference's."""

    def check(engine):
        attention = engine.runner.attention
        layers = engine.runner.arch.num_layers
        packed = attention.packed_prefixes
        packed.check_integrity()
        # every decode step of a cascade needs the prefix in every layer; packed once per
        # layer per prefix, the rest are reuses
        assert attention.cascade_passes >= 12 and attention.fused_decode_passes >= 10
        assert 0 < packed.packs <= 4 * layers < attention.cascade_passes * layers

    model = head_dim_64_model_dir
    assert two_rounds(model, "cpu", check) == two_rounds(model, "torch")


def test_deepest_shared_run_is_found_whoever_has_the_longest_prefix():
    """W1's shape: most users share system prompt + few-shot block; RAG users share only the
    system prompt and hold the longest prefixes. The few-shot users form one group at the deep
    prefix (not everyone at the shallow one); the RAG users pair up at the system prompt."""
    system, fewshot = list(range(100)), list(range(100, 300))
    lists = [torch.tensor(system + fewshot + [5000 + 10 * i]) for i in range(4)]
    lists += [torch.tensor(system + list(range(1000 * i, 1000 * i + 600))) for i in (7, 8)]
    prefix_lens = [s.numel() - 1 for s in lists]
    groups = find_shared_prefixes(lists, prefix_lens, 64)
    assert sorted((g.members, g.length) for g in groups) == [((0, 1, 2, 3), 300), ((4, 5), 100)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_native_merge_matches_the_reference(dtype, tol):
    """The CPU backend merges a cascade's halves natively; the torch merge is the reference,
    including lse far apart (one half negligible) and a head size off 16 lanes."""
    from runtime.model.attention.cascade import merge_partial
    from runtime.model.native.kernels import load_cpu_kernels

    gen = torch.Generator().manual_seed(3)
    for head_dim in (64, 20):
        out_a, out_b = torch.randn(2, 37, 6, head_dim, generator=gen).to(dtype)
        lse_a, lse_b = torch.randn(2, 37, 6, generator=gen) * 4
        lse_b[0] += 80  # half A negligible for row 0
        got = load_cpu_kernels().merge_attention(out_a, lse_a, out_b, lse_b)
        want = merge_partial(out_a, lse_a, out_b, lse_b)
        assert got.dtype == dtype
        assert (got.float() - want.float()).abs().max().item() < tol
