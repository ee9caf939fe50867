"""The native flash kernel (bf16 on vdpbf16ps, fp32 on FMAs) against a float64 reference on the
same inputs.

Shapes cover what the CPU backend sends: GQA groups of 1/3/4, head_dim 64 and 128, a few to
hundreds of query rows, key counts off the kernel's 32-key tiles and across its 256-key softmax
steps, causal (query rows are the last of the keys) or not, and K/V rows read with a stride (a
view of the pool). Its error must stay within the dtype's and no worse than torch's own flash
kernel's in that dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.attention.cascade import (
    causal_suffix_mask,
    flash_attention_with_lse,
)
from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported

pytestmark = pytest.mark.skipif(
    not native_flash_supported(), reason="this CPU lacks AVX-512 BF16 (the kernel is not built)"
)


def reference(q, k, v, scale, causal):
    """float64 attention of the inputs: out (n, heads, d), lse (n, heads)."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    group = heads // kv_heads
    kf = k.double().repeat_interleave(group, 1)
    vf = v.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kf) * scale
    if causal:
        pos = torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vf)
    return out, torch.logsumexp(scores, -1).T


def strided_kv(length, kv_heads, head_dim, dtype, gen):
    """K and V as views whose rows hold one more head than they show (a pool-like stride)."""
    k, v = torch.randn(2, length, kv_heads + 1, head_dim, generator=gen).to(dtype)
    return k[:, :kv_heads], v[:, :kv_heads]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    extra_keys=st.integers(0, 600),
    group=st.sampled_from([1, 3, 4]),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([64, 128]),
    causal=st.booleans(),
    strided=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_the_reference(
    n, extra_keys, group, kv_heads, head_dim, causal, strided, dtype, seed
):
    gen = torch.Generator().manual_seed(seed)
    length = n + extra_keys if causal else max(1, extra_keys)
    heads = group * kv_heads
    q = torch.randn(n, heads, head_dim, generator=gen).to(dtype)
    if strided:
        k, v = strided_kv(length, kv_heads, head_dim, dtype, gen)
    else:
        k, v = torch.randn(2, length, kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    out, lse = load_cpu_kernels().flash_attention(q, k, v, scale, causal)
    ref_out, ref_lse = reference(q, k, v, scale, causal)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (n, heads)
    assert (lse - ref_lse).abs().max().item() < 1e-4
    err = (out.double() - ref_out).abs().max().item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    # no worse than torch's flash kernel on the same inputs (plus the dtype's last bit)
    mask = causal_suffix_mask(n, length, dtype) if causal else None
    torch_out, _ = flash_attention_with_lse(q, k.contiguous(), v.contiguous(), scale, mask)
    torch_err = (torch_out.double() - ref_out).abs().max().item()
    assert err <= 2 * torch_err + (4e-3 if dtype == torch.bfloat16 else 1e-6)


def test_large_scores_stay_finite_and_exact_in_lse():
    """Scores in the hundreds (an unnormalised query) must not overflow the running max."""
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(40, 6, 64, generator=gen) * 30).bfloat16()
    k, v = torch.randn(2, 700, 2, 64, generator=gen).bfloat16()
    out, lse = load_cpu_kernels().flash_attention(q, k, v, 0.125, True)
    ref_out, ref_lse = reference(q, k, v, 0.125, True)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert (lse - ref_lse).abs().max().item() < 2e-2  # scores ~1e2: fp32 sums of bf16 products
    assert (out.double() - ref_out).abs().max().item() < 3e-2


@pytest.mark.parametrize(
    "shape_q,shape_kv,causal,dtype,message",
    [
        ((4, 6, 96), (10, 2, 96), False, torch.bfloat16, "head_dim 64 or 128"),
        ((12, 6, 64), (10, 2, 64), True, torch.bfloat16, "every query row needs a key"),
        ((4, 6, 64), (10, 4, 64), False, torch.float32, "multiple of KV heads"),
        ((4, 6, 64), (10, 2, 64), False, torch.float16, "bf16 or fp32"),
    ],
)
def test_bad_shapes_raise_naming_the_problem(shape_q, shape_kv, causal, dtype, message):
    q = torch.zeros(shape_q, dtype=dtype)
    k = torch.zeros(shape_kv, dtype=dtype)
    with pytest.raises(RuntimeError, match=message):
        load_cpu_kernels().flash_attention(q, k, k, 0.1, causal)


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 120),
    length=st.integers(1, 700),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([64, 128]),
    causal=st.booleans(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_packed_keys_and_row_map_give_the_plain_kernels_result(
    num_tokens, length, group, head_dim, causal, dtype, seed
):
    """flash_pack gathers keys by slot from a pool; flash_attention_packed reads the query rows
    it is given: together exactly flash_attention on the gathered rows and keys."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    pool_k, pool_v = torch.randn(2, 1000, kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(1000, generator=gen)[:length]
    q = torch.randn(num_tokens, group * kv_heads, head_dim, generator=gen).to(dtype)
    count = torch.randint(1, num_tokens + 1, (1,), generator=gen).item()
    if causal:
        count = min(count, length)
    rows = torch.randperm(num_tokens, generator=gen)[:count]
    kernels = load_cpu_kernels()
    k_packed, v_packed = kernels.flash_pack(pool_k, pool_v, slots)
    out, lse = kernels.flash_attention_packed(
        q, rows, k_packed, v_packed, length, head_dim**-0.5, causal
    )
    want_out, want_lse = kernels.flash_attention(
        q[rows].contiguous(), pool_k[slots], pool_v[slots], head_dim**-0.5, causal
    )
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_packed_calls_refuse_what_they_cannot_read():
    kernels = load_cpu_kernels()
    pool = torch.zeros(50, 2, 64)
    with pytest.raises(RuntimeError, match="slot 50 outside the pool of 50"):
        kernels.flash_pack(pool, pool, torch.tensor([3, 50]))
    k_packed, v_packed = kernels.flash_pack(pool, pool, torch.arange(40))
    q = torch.zeros(5, 6, 64)
    with pytest.raises(RuntimeError, match="disagree with length 70"):
        kernels.flash_attention_packed(q, torch.arange(5), k_packed, v_packed, 70, 0.1, False)
    with pytest.raises(RuntimeError, match="query row 5 outside q's 5 rows"):
        kernels.flash_attention_packed(q, torch.tensor([5]), k_packed, v_packed, 40, 0.1, False)
    with pytest.raises(RuntimeError, match="packed by flash_pack for q's dtype"):
        kernels.flash_attention_packed(
            q.bfloat16(), torch.arange(5), k_packed, v_packed, 40, 0.1, False
        )
