"""The native GGUF block-format GEMM (csrc/quant_gemm.cpp) against gguf's own dequantization
in float64: random weights quantized by `gguf.quants` to Q8_0 and Q4_1, and the default model's
real Q4_1 tensors. Both activation paths: (a) x as given, off the reference by fp32 summation
(and bf16's one rounding of the output); (b) x quantized to int8 per 32-block, off it by at most
what that rounding moves (half a step dx a value, times sum |w| of its block). Sizes off the
kernel's 16-output groups and 8-row blocks, odd block counts, bias or not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from runtime.model.native.kernels import GGML_Q4_1, GGML_Q8_0, load_cpu_kernels
from runtime.model.registry import DEFAULT_MODEL, MODELS, cache_dir

TYPES = {GGML_Q8_0: GGMLQuantizationType.Q8_0, GGML_Q4_1: GGMLQuantizationType.Q4_1}
U32 = 2.0**-24  # fp32's unit roundoff
U_BF16 = 2.0**-8  # bf16's


@pytest.fixture(scope="module")
def ops():
    kernels = load_cpu_kernels()
    if not kernels.quant_gemm_supported():
        pytest.skip("this CPU has no AVX-512 BF16 + VNNI")
    return kernels


def quantized(n_out: int, n_in: int, type_: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """GGUF bytes of random weights and what gguf dequantizes them to (float64)."""
    w = np.random.default_rng(seed).standard_normal((n_out, n_in)).astype(np.float32) * 0.05
    raw = quantize(w, TYPES[type_])
    return raw, torch.from_numpy(dequantize(raw, TYPES[type_])).double()


def block_scales(raw: np.ndarray, type_: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's block d and m (0 for Q8_0), so that |d q| = |w - m|."""
    size = 34 if type_ == GGML_Q8_0 else 20
    blocks = raw.reshape(raw.shape[0], -1, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0] if type_ == GGML_Q4_1 else 0 * d
    return per_weight(d), per_weight(m)


def per_weight(per_block: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(per_block.astype(np.float64)).repeat_interleave(32, dim=1)


def fp32_slack(x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 rounding's bound: the kernel sums d * sum(q x) + m * sum(x) blockwise, each
    rounding <= u of its terms, at most 32 (a block) + 2 a block + 4 (scales, bias) deep.
    bf16 x with Q4_1 sums d * sum((128 + q) x) + (m - 128 d) * sum(x): 128 |d| more a term."""
    depth = 32 + 2 * (x.shape[1] // 32) + 4
    terms = x.abs() @ ((w - m).abs() + m.abs() + 128 * d.abs()).T
    return depth * U32 * terms


def int8_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What quantizing x per 32-block (dx = max|x| / 127, xq = round(x / dx)) can move y:
    every x moves by at most dx / 2, so |dy| <= sum over blocks of dx / 2 * sum |w|
    (1e-6 for the fp32 steps of dx and x / dx)."""
    rows, n_in = x.shape
    dx = x.abs().view(rows, n_in // 32, 32).amax(-1) / 127  # (rows, blocks)
    w_abs = w.abs().view(w.shape[0], n_in // 32, 32).sum(-1)  # (out, blocks)
    return 0.5 * (1 + 1e-6) * dx @ w_abs.T


def check(ops, raw, w, type_, x, bias, quantize_x):
    n_out, n_in = w.shape
    packed = ops.quant_pack(torch.from_numpy(raw).reshape(-1), type_, n_out, n_in)
    y = ops.quant_gemm(x, packed, type_, bias, n_out, quantize_x)
    assert y.shape == (x.shape[0], n_out) and y.dtype == x.dtype
    xd = x.double()
    ref = xd @ w.T + (bias.double() if bias is not None else 0)
    d, m = block_scales(raw, type_, n_in)
    bound = 2 * fp32_slack(xd, w, d, m) + (bias.double().abs() * U32 if bias is not None else 0)
    if quantize_x:
        bound = bound + int8_bound(xd, w)
    if x.dtype == torch.bfloat16:  # the output's one rounding, of a result already off by bound
        bound = U_BF16 * (ref.abs() + bound) + bound
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item():.3g}"
    return err, bound


@pytest.mark.parametrize("type_", [GGML_Q8_0, GGML_Q4_1])
@pytest.mark.parametrize("quantize_x", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 96), (100, 576), (21, 1536)])
def test_quant_gemm_matches_gguf_dequantized(ops, type_, quantize_x, dtype, shape):
    n_out, n_in = shape  # odd outputs (groups of 16), 3 blocks (odd: Q8_0's group padding)
    raw, w = quantized(n_out, n_in, type_, seed=n_out)
    gen = torch.Generator().manual_seed(n_in)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        for bias in (None, torch.randn(n_out, generator=gen).to(dtype)):
            check(ops, raw, w, type_, x, bias, quantize_x)


def test_int8_bound_is_tight_enough_to_mean_something(ops):
    """(b)'s errors are of the order its bound says, and (a)'s far below them."""
    raw, w = quantized(64, 576, GGML_Q4_1, seed=1)
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(2))
    err_b, bound_b = check(ops, raw, w, GGML_Q4_1, x, None, True)
    err_a, _ = check(ops, raw, w, GGML_Q4_1, x, None, False)
    assert err_b.max() > 0.05 * bound_b.max()
    assert err_a.max() < 1e-3 * err_b.max()


def test_zero_rows_of_x_give_zeros_and_bias(ops):
    raw, w = quantized(20, 64, GGML_Q8_0, seed=3)
    packed = ops.quant_pack(torch.from_numpy(raw).reshape(-1), GGML_Q8_0, 20, 64)
    bias = torch.arange(20, dtype=torch.float32)
    for quantize_x in (False, True):  # an all-zero block has dx = 0: no division by it
        y = ops.quant_gemm(torch.zeros(2, 64), packed, GGML_Q8_0, bias, 20, quantize_x)
        assert torch.equal(y, bias.expand(2, 20))


def test_wrong_sizes_are_refused(ops):
    raw, _ = quantized(20, 64, GGML_Q4_1, seed=4)
    flat = torch.from_numpy(raw).reshape(-1)
    with pytest.raises(RuntimeError, match="GGUF bytes"):
        ops.quant_pack(flat, GGML_Q4_1, 21, 64)
    with pytest.raises(RuntimeError, match="not Q4_1"):
        ops.quant_pack(flat, 2, 20, 64)
    packed = ops.quant_pack(flat, GGML_Q4_1, 20, 64)
    with pytest.raises(RuntimeError, match="not quant_pack's"):
        ops.quant_gemm(torch.randn(1, 96), packed, GGML_Q4_1, None, 20)


@pytest.fixture(scope="module")
def default_gguf() -> GGUFReader:
    path = cache_dir() / "downloads" / MODELS[DEFAULT_MODEL].gguf_name
    if not path.is_file():
        pytest.skip(f"{path} is not here (the default model was never fetched)")
    return GGUFReader(path)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight"])
@pytest.mark.parametrize("quantize_x", [False, True])
def test_the_default_models_q4_1_tensors(ops, default_gguf, name, quantize_x):
    """An attention and an MLP weight of the shipped file, against gguf's dequantization."""
    tensor = next(t for t in default_gguf.tensors if t.name == name)
    assert tensor.tensor_type == GGMLQuantizationType.Q4_1
    raw = np.array(tensor.data)  # a writable copy of the memory-mapped bytes
    w = torch.from_numpy(dequantize(raw, tensor.tensor_type)).double()
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(5))
    for dtype in (torch.float32, torch.bfloat16):
        check(ops, raw, w, GGML_Q4_1, x.to(dtype), None, quantize_x)
