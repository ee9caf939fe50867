"""Shared prefixes packed for the flash kernel and kept across steps (the default cascades: a
prefix many sequences share is attended once for all their rows by flash).

A kept copy must never be stale: whatever the pool's writes in between (slots freed and reused
for other tokens), what the store hands out equals a fresh packing of the pool's rows now.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.pool import KVPool
from runtime.model.attention.packed_prefixes import PackedPrefixes
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported

pytestmark = pytest.mark.skipif(
    not native_flash_supported(), reason="this CPU lacks AVX-512 BF16 (the kernels are not built)"
)

SLOTS, KV_HEADS, HEAD_DIM, LAYERS = 256, 2, 64, 2


def entry_bytes(length: int, dtype: torch.dtype) -> int:
    padded = (length + 31) // 32 * 32
    return 2 * KV_HEADS * padded * HEAD_DIM * (4 if dtype == torch.float32 else 2)


operation = st.one_of(
    st.tuples(st.just("write"), st.integers(0, SLOTS - 1), st.integers(1, 12)),
    st.tuples(st.just("read"), st.integers(0, 3), st.integers(0, LAYERS - 1)),
    st.tuples(st.just("step")),
)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(operation, min_size=1, max_size=40),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    budget_entries=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_what_the_store_hands_out_equals_a_fresh_packing(ops, dtype, budget_entries, seed):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(LAYERS, SLOTS, KV_HEADS, HEAD_DIM, dtype)
    kernels = load_cpu_kernels()
    # four candidate prefixes: runs and scattered lists, some overlapping
    prefixes = [
        torch.arange(0, 40),
        torch.arange(20, 120),
        torch.randperm(SLOTS, generator=gen)[:70],
        torch.randperm(SLOTS, generator=gen)[:33],
    ]
    max_bytes = budget_entries * entry_bytes(100, dtype)
    store = PackedPrefixes(pool, kernels, max_bytes)
    for layer in range(LAYERS):
        new = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        pool.write(layer, torch.arange(SLOTS), new, -new)
    store.begin_step()
    for op in ops:
        if op[0] == "write":  # slots reused for other tokens, in every layer as a forward does
            _, first, count = op
            slots = torch.arange(first, min(SLOTS, first + count))
            for layer in range(LAYERS):
                rows = torch.randn(slots.numel(), KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                pool.write(layer, slots, rows, rows * 2)
        elif op[0] == "read":
            _, which, layer = op
            entry = store.get(prefixes[which])
            k_packed, v_packed = store.packed(entry, layer)
            fresh_k, fresh_v = kernels.flash_pack(pool.k[layer], pool.v[layer], prefixes[which])
            assert torch.equal(k_packed, fresh_k) and torch.equal(v_packed, fresh_v)
        else:
            store.begin_step()
        store.check_integrity()
    store.begin_step()
    entry = store.get(prefixes[0])  # a read after the step: entries beyond the budget go
    store.packed(entry, 0)
    assert store.nbytes <= max(max_bytes, entry.nbytes)


def test_an_unchanged_prefix_is_packed_once_per_layer():
    pool = KVPool(LAYERS, SLOTS, KV_HEADS, HEAD_DIM, torch.bfloat16)
    store = PackedPrefixes(pool, load_cpu_kernels(), 1 << 30)
    prefix = torch.arange(10, 90)
    for _ in range(5):  # five steps of a cascade over every layer
        store.begin_step()
        entry = store.get(prefix)
        for layer in range(LAYERS):
            store.packed(entry, layer)
        pool.write(0, torch.tensor([200, 201]), *torch.zeros(2, 2, KV_HEADS, HEAD_DIM).bfloat16())
    assert store.packs == LAYERS
    pool.write(1, torch.tensor([50]), *torch.zeros(2, 1, KV_HEADS, HEAD_DIM).bfloat16())
    store.begin_step()
    entry = store.get(prefix)  # slot 50 rewritten: packed again
    store.packed(entry, 0)
    assert store.packs == LAYERS + 1
