"""Shared prefixes packed for the flash kernel and kept across steps, and the default cascade's
fused decode that attends them.

A kept copy must never be stale: whatever the pool's writes in between (slots freed and reused
for other tokens), what the store hands out equals a fresh packing of the pool's rows now. The
fused decode (prefix by flash, suffix and merge inside the paged kernel, rows read and written
in place) must give attention over prefix + suffix in both dtypes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import scattered_prefix, suffix_slots
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


def reference(q, k, v, scale):
    """float64 attention of single-row queries q (B, H, D) over their keys (L_b, KVH, D)."""
    outs = []
    for row, keys, values in zip(q, k, v, strict=True):
        group = row.shape[0] // keys.shape[1]
        kf = keys.double().repeat_interleave(group, 1)
        vf = values.double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", row.double(), kf) * scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), vf))
    return torch.stack(outs)


def flash_prefix(kernels, q, rows, pool_k, pool_v, prefix, scale):
    """q's `rows` over the packed prefix by flash, as the default cascade hands them to the
    merge: (fp32 out, lse)."""
    k_packed, v_packed = kernels.flash_pack(pool_k, pool_v, prefix)
    out, lse = kernels.flash_attention_packed(
        q, rows, k_packed, v_packed, prefix.numel(), scale, False
    )
    return out.float(), lse


@settings(max_examples=30, deadline=None)
@given(
    members=st.integers(1, 20),
    prefix_len=st.integers(1, 400),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    extra_rows=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_fused_decode_merge_attends_prefix_and_suffix(
    members, prefix_len, group, head_dim, dtype, extra_rows, seed
):
    """Each member's query row (scattered among other rows of q) over the shared prefix and
    its own suffix (0 to 300 keys, scattered slots): written into its row of out, and nothing
    else written."""
    gen = torch.Generator().manual_seed(seed)
    pool_k, pool_v, prefix, free, heads = scattered_prefix(gen, group, head_dim, dtype, prefix_len)
    lengths = torch.randint(0, 300, (members,), generator=gen)
    suffixes = suffix_slots(free, lengths)
    num_tokens = members + extra_rows
    q = torch.randn(num_tokens, heads, head_dim, generator=gen).to(dtype)
    rows = torch.randperm(num_tokens, generator=gen)[:members]
    kernels = load_cpu_kernels()
    scale = head_dim**-0.5
    prefix_out, prefix_lse = flash_prefix(kernels, q, rows, pool_k, pool_v, prefix, scale)
    indptr = torch.zeros(members + 1, dtype=torch.int64)
    indptr[1:] = lengths.cumsum(0)
    out = torch.full_like(q, 7.0)
    single = torch.arange(members + 1)
    kernels.paged_decode_merge(
        q, pool_k, pool_v, torch.cat(suffixes), indptr, single, rows, prefix_out, prefix_lse,
        scale, 0, out,
    )  # fmt: skip
    keys = [torch.cat([prefix, s]) for s in suffixes]
    want = reference(q[rows], [pool_k[k] for k in keys], [pool_v[k] for k in keys], scale)
    err = (out[rows].double() - want).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    untouched = torch.ones(num_tokens, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 7.0).all()


@settings(max_examples=30, deadline=None)
@given(
    rows_per_member=st.lists(st.integers(1, 16), min_size=1, max_size=6),
    prefix_len=st.integers(1, 300),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_fused_decode_merge_verifies_a_draft_as_single_decodes_would(
    rows_per_member, prefix_len, group, head_dim, dtype, seed
):
    """Each member's n rows (a verified draft: the last n of its own keys, causal among them)
    in one call give bit for bit what n single-row calls over the growing suffix give: in a
    cascade too, a draft's rows round as the plain decodes they replace."""
    gen = torch.Generator().manual_seed(seed)
    pool_k, pool_v, prefix, free, heads = scattered_prefix(gen, group, head_dim, dtype, prefix_len)
    counts = torch.tensor(rows_per_member)
    lengths = counts + torch.randint(0, 200, counts.shape, generator=gen)
    suffixes = suffix_slots(free, lengths)
    num_rows = int(counts.sum())
    q = torch.randn(num_rows + 3, heads, head_dim, generator=gen).to(dtype)
    rows = torch.arange(2, 2 + num_rows)  # consecutive per member, after two other rows
    kernels = load_cpu_kernels()
    scale = head_dim**-0.5
    prefix_out, prefix_lse = flash_prefix(kernels, q, rows, pool_k, pool_v, prefix, scale)
    kv_indptr, qo_indptr = torch.zeros(2, counts.numel() + 1, dtype=torch.int64)
    kv_indptr[1:], qo_indptr[1:] = lengths.cumsum(0), counts.cumsum(0)
    out = torch.full_like(q, 7.0)
    kernels.paged_decode_merge(
        q, pool_k, pool_v, torch.cat(suffixes), kv_indptr, qo_indptr, rows, prefix_out,
        prefix_lse, scale, 0, out,
    )  # fmt: skip
    for b, (n, suffix) in enumerate(zip(rows_per_member, suffixes, strict=True)):
        for r in range(n):
            i = int(qo_indptr[b]) + r
            visible = suffix[: suffix.numel() - n + r + 1]
            one = torch.full_like(q, 7.0)
            kernels.paged_decode_merge(
                q, pool_k, pool_v, visible, torch.tensor([0, visible.numel()]),
                torch.tensor([0, 1]), rows[i : i + 1], prefix_out[i : i + 1],
                prefix_lse[i : i + 1], scale, 0, one,
            )  # fmt: skip
            assert torch.equal(out[rows[i]], one[rows[i]]), (b, r)
    assert (out[:2] == 7.0).all() and (out[2 + num_rows :] == 7.0).all()
