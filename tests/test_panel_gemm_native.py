"""The native panel GEMM (csrc/panel_gemm.cpp) against a float64 reference, and Linear's use of
it: up to PANEL_MAX_ROWS rows go through it, more through oneDNN, and the two agree to the
dtype's precision; a forward that verifies drafts keeps it up to DECODE_PANEL_MAX_ROWS, each row
then the bits it gets alone; in a batch-invariant forward, decode-shaped sequences' rows and the
logits' rows always take it and longer extends' rows oneDNN, so each row gets the bits it gets
in any other batch. Sizes off the kernel's 48-feature panels, 8-row blocks, 16/32 lanes and bf16
pairs (odd in_features) are covered."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.model.linear import (
    DECODE_PANEL_MAX_ROWS,
    PANEL_MAX_ROWS,
    Linear,
    decode_shaped,
    native_panel_gemm,
    packed_gemm_available,
    routed_rows,
)
from runtime.model.native.kernels import MAX_DECODE_ROWS, load_cpu_kernels

# relative to the largest |y|: fp32 sums in another order; bf16 rounds its output once
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    assert kernels.panel_gemm_supported()
    return kernels


@settings(max_examples=60, deadline=None)
# one output that nearly cancels: its error is relative to the terms summed, not to the result
@example(rows=1, in_features=15, out_features=1, dtype=torch.float32, with_bias=True, seed=29802)
@given(
    rows=st.integers(1, 70),
    in_features=st.sampled_from([1, 2, 15, 16, 33, 64, 100, 576, 1001]),
    out_features=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_panel_gemm_matches_a_float64_reference(
    ops, rows, in_features, out_features, dtype, with_bias, seed
):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    y = ops.panel_gemm(x, ops.panel_pack(w), bias, out_features)
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    terms = x.double().abs() @ w.double().abs().T + (bias.double().abs() if with_bias else 0)
    scale = terms.max().item() + 1e-12  # the size of what was summed: rounding scales with it
    assert (y.double() - ref).abs().max().item() / scale < TOLERANCE[dtype]


def test_panel_gemm_reads_strided_rows_and_writes_every_output(ops):
    x = torch.randn(20, 9, 70)[:, 3, :]  # rows 630 floats apart
    w = torch.randn(97, 70)
    y = ops.panel_gemm(x, ops.panel_pack(w), None, 97)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


def test_panel_gemm_refuses_what_it_cannot_run_by_name(ops):
    w = torch.randn(50, 16)
    panels = ops.panel_pack(w)
    with pytest.raises(RuntimeError, match="not panel_pack's"):
        ops.panel_gemm(torch.randn(1, 15), panels, None, 50)
    with pytest.raises(RuntimeError, match="not panel_pack's"):
        ops.panel_gemm(torch.randn(1, 16), panels, None, 200)
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.panel_gemm(torch.randn(1, 16).bfloat16(), panels, None, 50)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.panel_gemm(torch.randn(1, 16).double(), panels, None, 50)
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_gemm(torch.randn(1, 16), panels, torch.randn(7), 50)
    with pytest.raises(RuntimeError, match="non-empty"):
        ops.panel_pack(torch.randn(0, 16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.panel_pack(w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_sends_decode_batches_to_the_panel_gemm_and_agrees_with_onednn(dtype):
    assert packed_gemm_available(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=gen).to(dtype)
    bias = torch.randn(200, generator=gen).to(dtype)
    linear = Linear(w, bias, pack=True)
    assert native_panel_gemm(w) is not None and linear.panels is not None
    ops = load_cpu_kernels()
    calls = []

    class Counting:  # the kernels' ops, counting the panel GEMM's calls by rows
        def panel_gemm(self, x, *args):
            calls.append(x.shape[0])
            return ops.panel_gemm(x, *args)

    linear._native = Counting()
    limit = PANEL_MAX_ROWS[dtype]
    x = torch.randn(limit + 9, 96, generator=gen).to(dtype)
    batched = linear(x)  # more rows than the limit: oneDNN
    assert calls == []
    for rows in (1, 2, 5, 8, limit):
        few = linear(x[:rows])
        assert calls[-1] == rows, "decode batches go through the panel GEMM"
        assert torch.equal(few, ops.panel_gemm(x[:rows], linear.panels, bias, 200))
        scale = batched.abs().max().item()
        err = (few.double() - batched[:rows].double()).abs().max().item() / scale
        assert err < TOLERANCE[dtype]
    assert Linear(w, bias, pack=False).panels is None  # no second copy without packing


def test_released_openmp_workers_come_back_for_the_next_parallel_region(ops):
    w = torch.randn(500, 300)
    x = torch.randn(40, 300)  # 11 panels: both threads take part
    panels = ops.panel_pack(w)
    before = ops.panel_gemm(x, panels, None, 500)
    assert ops.release_openmp_workers() == 0
    assert torch.equal(ops.panel_gemm(x, panels, None, 500), before)
    assert ops.release_openmp_workers() == 0  # again, with a fresh pool to release


@settings(max_examples=25, deadline=None)
@given(
    extend_lens=st.lists(
        st.one_of(st.integers(1, MAX_DECODE_ROWS), st.integers(MAX_DECODE_ROWS + 1, 80)),
        min_size=1,
        max_size=24,
    ),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
@example(extend_lens=[17, 17], dtype=torch.bfloat16, seed=0)  # oneDNN's bf16 rows vary with M
def test_a_row_gets_the_same_bits_in_any_batch(extend_lens, dtype, seed):
    """Within a forward of any mix of decodes, verified drafts and extends, a decode-shaped
    sequence's rows equal its rows computed alone, an extend's rows equal its rows alone through
    oneDNN, and the LM head's rows equal each row alone, whatever the row count."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(480, 576, generator=gen) * 0.05).to(dtype)
    linear, head = Linear(w, None, pack=True), Linear(w, None, pack=True, logits=True)
    x = torch.randn(sum(extend_lens), 576, generator=gen).to(dtype)
    with routed_rows(tuple(extend_lens)):
        together = linear(x)
        logits = head(x)
    start = 0
    for n in extend_lens:
        rows = x[start : start + n]
        if n <= MAX_DECODE_ROWS:
            with routed_rows((n,)):
                assert torch.equal(together[start : start + n], linear(rows))
        else:
            onednn = torch.ops.mkldnn._linear_pointwise(rows, linear.weight, None, "none", [], "")
            assert torch.equal(together[start : start + n], onednn)
        start += n
    one_by_one = torch.cat([head(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(logits, one_by_one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_take_the_panel_however_many(dtype):
    """256 decode rows (or 16 drafts of 16) inside a forward: each row exactly as alone, where
    oneDNN (what the same rows get outside a forward) sums in another order."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).to(dtype)  # SmolLM2's gate_up
    linear = Linear(w, None, pack=True)
    x = torch.randn(256, 576, generator=gen).to(dtype)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
    onednn = linear(x)  # no forward context: past PANEL_MAX_ROWS, oneDNN
    for lens in ((16,) * 16, (1,) * 256):
        with routed_rows(lens):
            assert torch.equal(linear(x), alone)
    if dtype == torch.bfloat16:  # the rule matters here: oneDNN rounds some elements otherwise
        assert not torch.equal(onednn, alone)
    assert torch.equal(linear(x), onednn)  # the context is gone after the forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_verifying_forward_keeps_every_row_as_it_is_alone(dtype):
    """A verifying pass (16 requests x a draft of up to 15 and its real token) has up to 256
    rows: inside `decode_shaped` each row gets exactly what it gets as a one-row decode, where
    oneDNN (what the same rows get in a prefill-shaped forward) sums in another order."""
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).to(dtype)  # SmolLM2's gate_up
    linear = Linear(w, None, pack=True)
    x = torch.randn(DECODE_PANEL_MAX_ROWS, 576, generator=gen).to(dtype)
    alone = torch.cat([linear(x[i : i + 1]) for i in range(x.shape[0])])
    onednn = linear(x)  # no forward context: past PANEL_MAX_ROWS, oneDNN
    with decode_shaped((16,) * 16):
        assert torch.equal(linear(x), alone)
        assert torch.equal(linear(x[:40]), alone[:40])
    with decode_shaped((16,) * 15 + (17,)):  # one sequence extends past a draft: oneDNN
        assert torch.equal(linear(x), onednn)
    with decode_shaped((1,) * 256):  # plain decodes keep the limit each GEMM is fastest at
        assert torch.equal(linear(x), onednn)
    if dtype == torch.bfloat16:  # the rule matters here: oneDNN rounds some elements otherwise
        assert not torch.equal(onednn, alone)
    assert torch.equal(linear(x), onednn)  # the context is gone after the forward
