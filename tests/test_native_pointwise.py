"""Native pointwise ops (CPU) against the torch reference's numerics: RMSNorm, residual add +
RMSNorm, RoPE, SiLU-and-mul.

Every rounding the reference makes in the model dtype is made natively too, so in bf16 the
residual sum and RoPE are bit-identical; the norm may differ by the fp32 sum's order (a bf16
step on a rare element) and SiLU by its exponential's last fp32 bit (likewise). fp32 differs
by a few ulps (fused multiply-adds). Sizes off the kernels' 16 lanes are covered.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model.pointwise import NativeCpuOps, RopeTables, TorchOps, pointwise_ops


@pytest.fixture(scope="module")
def native() -> NativeCpuOps:
    ops = pointwise_ops(
        torch.device("cpu"), gemma_norms=False, hidden_act="silu", dtype=torch.float32
    )
    assert isinstance(ops, NativeCpuOps)
    return ops


def test_gemma_norms_keep_the_reference():
    ops = pointwise_ops(
        torch.device("cpu"), gemma_norms=True, hidden_act="gelu_pytorch_tanh", dtype=torch.float32
    )
    assert type(ops) is TorchOps


def test_flashinfer_norms_only_for_half_precision(monkeypatch):
    """flashinfer's fused norms take fp16/bf16 only: an fp32 engine on CUDA keeps the reference."""
    import importlib.util
    import sys
    import types

    real_find_spec = importlib.util.find_spec
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "flashinfer" else real_find_spec(name, *a),
    )
    cuda = torch.device("cuda")
    assert pointwise_ops(cuda, False, "silu", torch.bfloat16).name == "flashinfer"
    assert type(pointwise_ops(cuda, False, "silu", torch.float32)) is TorchOps


def rounding_flips_are_rare(differs: torch.Tensor) -> bool:
    """Under 1% of the elements, and one at most in a tensor of fewer than 100: a flip is a
    chance event (a sum on a rounding midpoint), so one in 16 elements is not a wrong kernel."""
    return int(differs.sum()) <= max(1, differs.numel() // 100)


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 70),
    hidden=st.sampled_from([16, 100, 576, 1000]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_native_norms_match_the_reference(native, tokens, hidden, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hidden, generator=gen) * scale).to(dtype)
    residual = (torch.randn(tokens, hidden, generator=gen) * scale).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    reference = TorchOps()
    want_out, want_sum = reference.add_rms_norm(x, residual, weight, 1e-5)
    got_out, got_sum = native.add_rms_norm(x, residual, weight, 1e-5)
    assert got_out.dtype == dtype and got_out.shape == x.shape
    assert torch.equal(got_sum, want_sum)
    for got, want in (
        (got_out, want_out),
        (native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5)),
    ):
        diff = (got.float() - want.float()).abs()
        if dtype == torch.float32:
            assert (diff <= 1e-5 * want.float().abs().clamp_min(1e-3)).all()
        else:  # a bf16 step or two (2^-8..2^-7 each) where the fp32 sums round differently
            assert (diff <= 2**-6 * want.float().abs() + 1e-30).all()
            assert rounding_flips_are_rare(got != want)


def test_bad_input_names_the_problem(native):
    x = torch.zeros(3, 8)
    with pytest.raises(RuntimeError, match="weight"):
        native.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)


def assert_close_in_dtype(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert (diff <= 1e-5 * want.float().abs() + 1e-6).all()
    else:
        # two bf16 steps: an intermediate on a rounding midpoint flips, then is rounded again
        assert (diff <= 2**-6 * want.float().abs() + 1e-30).all()
        # values under 1e-30 (silu of a very negative gate) may underflow to 0 in the native
        # exponential: within the absolute floor above, and not a rounding flip
        assert rounding_flips_are_rare((got != want) & (diff > 1e-30))


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 40),
    intermediate=st.sampled_from([16, 40, 1536]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([0.1, 3.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_native_silu_and_mul_matches_the_reference(
    native, tokens, intermediate, dtype, scale, seed
):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(tokens, 2 * intermediate, generator=gen) * scale).to(dtype)
    assert_close_in_dtype(native.act_mul(gate_up), TorchOps().act_mul(gate_up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_stays_finite_at_extreme_gates(native, dtype):
    """e^-x overflows past |x| = 88 in fp32: the kernel must not turn that into NaN."""
    gate = torch.tensor([-1e4, -200.0, -100.0, -89.0, -20.0, 0.0, 20.0, 89.0, 200.0, 1e4] * 2)
    gate_up = torch.cat([gate, torch.full_like(gate, 0.5)])[None].to(dtype)
    got, want = native.act_mul(gate_up), TorchOps().act_mul(gate_up)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want.float()).abs().max().item() <= 2**-6 * 1e4 * 0.5


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.integers(1, 40),
    heads=st.integers(1, 9),
    head_dim=st.sampled_from([16, 64, 128]),
    partial=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_native_rope_matches_the_reference(native, tokens, heads, head_dim, partial, dtype, seed):
    """q and k as views of one fused QKV row (strided), partial rotary too."""
    gen = torch.Generator().manual_seed(seed)
    rotary = head_dim // 2 if partial else head_dim
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    tables = RopeTables.build(inv_freq, 1.0, 512, dtype, torch.device("cpu"), False)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + 1) * head_dim].view(tokens, 1, head_dim)
    reference = TorchOps()
    want_q, want_k = reference.rope(q, k, reference.rope_context(positions, tables))
    got_q, got_k = native.rope(q, k, native.rope_context(positions, tables))
    if dtype == torch.bfloat16:  # the same three roundings: bit for bit
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert_close_in_dtype(got_q, want_q)
    assert_close_in_dtype(got_k, want_k)
