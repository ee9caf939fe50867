"""The native GGUF block-format GEMM (csrc/quant_gemm.cpp) against gguf's own dequantization
in float64: random weights quantized by `gguf.quants` to Q8_0, Q4_1, Q4_0 and Q5_0, random
Q4_K and Q6_K super-blocks (gguf-py dequantizes those but does not quantize them), and the
default model's real Q4_1 tensors. Both activation paths: (a) x as given, off the reference
by fp32 summation (and bf16's one rounding of the output); (b) x quantized to int8 per
32-block, off it by at most what that rounding moves (half a step dx a value, times sum |w| of
its block). Sizes off the kernel's 16-output groups and 8-row blocks, odd block counts, bias or
not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize, quantize

from runtime.model.native.kernels import (
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q5_0,
    GGML_Q6_K,
    GGML_Q8_0,
    load_cpu_kernels,
)
from runtime.model.registry import DEFAULT_MODEL, MODELS, cache_dir

TYPES = {
    GGML_Q8_0: GGMLQuantizationType.Q8_0,
    GGML_Q4_1: GGMLQuantizationType.Q4_1,
    GGML_Q4_0: GGMLQuantizationType.Q4_0,
    GGML_Q5_0: GGMLQuantizationType.Q5_0,
    GGML_Q4_K: GGMLQuantizationType.Q4_K,
    GGML_Q6_K: GGMLQuantizationType.Q6_K,
}
K_TYPES = (GGML_Q4_K, GGML_Q6_K)  # super-blocks of 256
BLOCK_BYTES = {GGML_Q8_0: 34, GGML_Q4_1: 20, GGML_Q4_0: 18, GGML_Q5_0: 22}
BLOCK_BYTES.update({GGML_Q4_K: 144, GGML_Q6_K: 210})
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
    rng = np.random.default_rng(seed)
    if type_ in K_TYPES:
        raw = random_super_blocks(rng, n_out, n_in, type_)
    else:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = quantize(w, TYPES[type_])
    return raw, torch.from_numpy(dequantize(raw, TYPES[type_])).double()


def random_super_blocks(rng, n_out: int, n_in: int, type_: int) -> np.ndarray:
    """Q4_K / Q6_K bytes: random quants and 6-bit (Q4_K) or int8 (Q6_K) scales, fp16 d (and
    Q4_K's dmin) of either sign around 1e-4 (weights of ~0.05 like the others')."""
    raw = rng.integers(0, 256, (n_out, n_in // 256, BLOCK_BYTES[type_]), dtype=np.uint8)
    for at in (0, 2) if type_ == GGML_Q4_K else (208,):
        d = rng.choice([-1, 1], raw.shape[:2]) * rng.uniform(0.5, 2, raw.shape[:2]) * 1e-4
        raw[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n_out, -1)


def fp16_at(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def block_scales(raw: np.ndarray, type_: int, n_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each weight's scale d and offset m as the kernel applies them, w = d q + m with q the
    integer it multiplies (Q4_0: m = -8 d; Q4_K: d sc and -dmin min of its 32-block; Q6_K: d
    scale of its 16 elements), so that |d q| = |w - m|."""
    blocks = raw.reshape(raw.shape[0], -1, BLOCK_BYTES[type_])
    n_out, n_blocks = blocks.shape[:2]
    if type_ == GGML_Q4_K:
        sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).copy())
        d = fp16_at(blocks, 0)[..., None] * sc.reshape(n_out, n_blocks, 8)
        m = -fp16_at(blocks, 2)[..., None] * mins.reshape(n_out, n_blocks, 8)
        return per_weight(d.reshape(n_out, -1)), per_weight(m.reshape(n_out, -1))
    if type_ == GGML_Q6_K:
        d = fp16_at(blocks, 208)[..., None] * blocks[..., 192:208].view(np.int8)
        d = per_weight(d.reshape(n_out, -1), 16)
        return d, 0 * d
    d = fp16_at(blocks, 0)
    m = {GGML_Q4_1: fp16_at(blocks, 2), GGML_Q4_0: -8 * d}.get(type_, 0 * d)
    return per_weight(d), per_weight(m)


def per_weight(per_block: np.ndarray, size: int = 32) -> torch.Tensor:
    return torch.from_numpy(per_block.astype(np.float64)).repeat_interleave(size, dim=1)


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


# odd outputs (groups of 16), 3 blocks (odd: Q8_0's group padding); K types: 1-3 super-blocks
SHAPES = [(37, 96), (100, 576), (21, 1536)]
K_SHAPES = [(37, 256), (100, 512), (21, 768)]
CASES = [
    pytest.param(t, s, id=f"{TYPES[t].name}-{s[0]}x{s[1]}")
    for t in TYPES
    for s in (K_SHAPES if t in K_TYPES else SHAPES)
]


@pytest.mark.parametrize(("type_", "shape"), CASES)
@pytest.mark.parametrize("quantize_x", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_gemm_matches_gguf_dequantized(ops, type_, shape, quantize_x, dtype):
    n_out, n_in = shape
    raw, w = quantized(n_out, n_in, type_, seed=n_out)
    gen = torch.Generator().manual_seed(n_in)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, n_in, generator=gen).to(dtype)
        for bias in (None, torch.randn(n_out, generator=gen).to(dtype)):
            check(ops, raw, w, type_, x, bias, quantize_x)


@pytest.mark.parametrize("type_", list(TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_alike_sums_each_row_as_it_is_alone(ops, type_, dtype):
    """rows_alike (batch-invariant and speculating engines): a row's output is bit for bit the
    same in a batch of any size, at any position, as alone, and alone as without the flag.
    Without it, batches of 3 rows or more sum in another order (checked in fp32, where that
    shows: the flag matters; bf16's rounding of the output hides it)."""
    n_out, n_in = (37, 512) if type_ in K_TYPES else (37, 576)
    raw, _ = quantized(n_out, n_in, type_, seed=7)
    packed = ops.quant_pack(torch.from_numpy(raw).reshape(-1), type_, n_out, n_in)
    x = torch.randn(17, n_in, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(n_out, generator=torch.Generator().manual_seed(4)).to(dtype)
    alone = [
        ops.quant_gemm(x[r : r + 1], packed, type_, bias, n_out, False, True) for r in range(17)
    ]
    plain = ops.quant_gemm(x[:1], packed, type_, bias, n_out, False, False)
    assert torch.equal(alone[0], plain)
    for rows in (2, 3, 5, 8, 17):
        y = ops.quant_gemm(x[:rows], packed, type_, bias, n_out, False, True)
        for r in range(rows):
            assert torch.equal(y[r : r + 1], alone[r]), (rows, r)
    if dtype == torch.float32:
        batched = ops.quant_gemm(x, packed, type_, bias, n_out, False, False)
        assert not torch.equal(batched, torch.cat(alone))


@pytest.mark.parametrize(("type_", "n_in"), [(GGML_Q4_1, 576), (GGML_Q6_K, 512)])
def test_int8_bound_is_tight_enough_to_mean_something(ops, type_, n_in):
    """(b)'s errors are of the order its bound says, and (a)'s far below them."""
    raw, w = quantized(64, n_in, type_, seed=1)
    x = torch.randn(8, n_in, generator=torch.Generator().manual_seed(2))
    err_b, bound_b = check(ops, raw, w, type_, x, None, True)
    err_a, _ = check(ops, raw, w, type_, x, None, False)
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
    with pytest.raises(RuntimeError, match="not one of"):
        ops.quant_pack(flat, 7, 20, 64)  # Q5_1
    packed = ops.quant_pack(flat, GGML_Q4_1, 20, 64)
    with pytest.raises(RuntimeError, match="not quant_pack's"):
        ops.quant_gemm(torch.randn(1, 96), packed, GGML_Q4_1, None, 20)


@pytest.mark.parametrize("type_", K_TYPES)
def test_k_types_need_whole_super_blocks(ops, type_):
    """Q4_K / Q6_K rows are super-blocks of 256: an input size off them is refused by name."""
    raw, _ = quantized(20, 256, type_, seed=6)
    flat = torch.from_numpy(raw).reshape(-1)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.quant_pack(flat, type_, 20, 288)
    packed = ops.quant_pack(flat, type_, 20, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.quant_gemm(torch.randn(1, 288), packed, type_, None, 20)


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
