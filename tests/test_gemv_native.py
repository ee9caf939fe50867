"""The native few-row GEMV (csrc/gemv.cpp) against a float64 reference, and Linear's use of it:
forwards of up to `gemv_max_rows()` tokens go through it, larger ones through oneDNN, and the
two agree to the dtype's precision. Sizes off the kernel's 16/32 lanes are covered."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.linear import Linear, native_gemv, packed_gemm_available
from runtime.model.native.kernels import load_cpu_kernels

# relative to the largest |y|: fp32 sums in another order; bf16 rounds its output once
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    assert kernels.native_gemv_supported()
    return kernels


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    in_features=st.sampled_from([1, 15, 16, 33, 64, 100, 576, 1000]),
    out_features=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gemv_matches_a_float64_reference(
    ops, rows, in_features, out_features, dtype, with_bias, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    y = ops.gemv(x, w, bias)
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    scale = ref.abs().max().item() + 1e-12
    assert (y.double() - ref).abs().max().item() / scale < TOLERANCE[dtype]


def test_gemv_refuses_what_it_cannot_run_by_name(ops):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        ops.gemv(torch.randn(5, 16), w, None)
    with pytest.raises(RuntimeError, match="features"):
        ops.gemv(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.gemv(torch.randn(1, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.gemv(torch.randn(1, 16).double(), w.double(), None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gemv(torch.randn(1, 16), w, torch.randn(7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sends_few_rows_to_the_gemv_and_agrees_with_onednn(dtype):
    assert packed_gemm_available(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype)
    linear = Linear(w, bias, pack=True)
    assert native_gemv(w) is not None and linear.row_major is not None
    x = torch.randn(9, 96, generator=gen).to(dtype)
    batched = linear(x)  # 9 rows: oneDNN
    for rows in (1, 2, 4):
        few = linear(x[:rows])
        gemv = load_cpu_kernels().gemv(x[:rows], w, bias)
        assert torch.equal(few, gemv), "few rows go through the GEMV"
        scale = batched.abs().max().item()
        err = (few.double() - batched[:rows].double()).abs().max().item() / scale
        assert err < TOLERANCE[dtype]
    assert Linear(w, bias, pack=False).row_major is None  # no second copy without packing
