"""Quantized Hugging Face checkpoints, dequantized to plain fp32 `<layer>.weight` tensors at load.

The engine's forward takes plain weight matrices [out, in] and casts them to its dtype; it has no
quantized kernels yet. So a quantized folder is turned, once, into exactly the tensors an
unquantized checkpoint of the same model has: every quantization tensor is consumed, and one
that is left over or missing is a CheckpointError naming it (never garbage weights). The method
is `config.json`'s `quantization_config`:

- `compressed-tensors` (vLLM / llm-compressor), FP8 e4m3: `<layer>.weight` float8_e4m3fn and
  `<layer>.weight_scale` per tensor ([] or [1]), per channel ([out, 1]), per group
  ([out, in/group]) or per block (`block_structure`). W = weight * weight_scale.
- `fp8` (transformers' FineGrainedFP8, DeepSeek-V3): `<layer>.weight` float8_e4m3fn and
  `<layer>.weight_scale_inv` [ceil(out/bo), ceil(in/bi)] for `weight_block_size` [bo, bi] (or
  one scale): W = weight * the scale of its block, blocks cropped at the edges.
- `awq` version gemm, 4-bit: `qweight` int32 [in, out/8] and `qzeros` int32 [in/group, out/8]
  packed along the output dim in AutoAWQ's nibble order (0, 2, 4, 6, 1, 3, 5, 7), `scales` fp16
  [in/group, out]. W[in, out] = (q - z) * s, transposed to [out, in].
- `gptq` (AutoGPTQ / GPTQModel), 4 or 8 bits: `qweight` int32 [in/pack, out] packed along the
  input dim, `qzeros` int32 [groups, out/pack] along the output dim (low bits first, both),
  `scales` fp16 [groups, out], `g_idx` [in] (each input row's group: act-order permutes it).
  The v1 format ("gptq") stores z - 1, v2 ("gptq_v2") z. W[in, out] = (q - z[g]) * s[g].

Static activation scales (`input_scale`, `activation_scale`) and FP8 KV-cache scales are
dropped with one warning: activations and the KV cache run in the engine's dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from runtime.model.loader import CheckpointError

log = logging.getLogger("flowlang.model")

SUPPORTED = (
    "compressed-tensors (FP8 e4m3 weights), fp8 (FP8 e4m3, block-wise or per-tensor), "
    "awq (version gemm, 4-bit, zero point), gptq (4 or 8 bits, format gptq or gptq_v2)"
)
# what activations or the KV cache would be quantized with; unused while they stay unquantized
STATIC_SCALES = (".input_scale", ".activation_scale", ".k_scale", ".v_scale")
# every tensor kind a quantized layer has: none may survive dequantization
QUANT_SUFFIXES = (
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
    ".weight_scale",
    ".weight_scale_inv",
    ".weight_zero_point",
    *STATIC_SCALES,
)
AWQ_UNDO_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # inverts AutoAWQ's packing order (0, 2, 4, 6, 1, ...)
Weights = dict[str, torch.Tensor]


def dequantize(weights: Weights, quant: dict) -> Weights:
    """A quantized checkpoint's weights as an unquantized one names them: quantized layers
    dequantized to fp32, other tensors as stored; `quant` is its quantization_config."""
    method = str(quant.get("quant_method", "<none>")).lower()
    convert = METHODS.get(method)
    if convert is None:
        raise CheckpointError(
            f"quantization method {method!r} is not supported; flowlang loads {SUPPORTED}"
        )
    plain = convert(_drop_static_scales(dict(weights)), quant)
    for name, tensor in plain.items():
        if name.endswith(QUANT_SUFFIXES) or (
            tensor.dtype.is_floating_point and tensor.itemsize == 1
        ):
            raise CheckpointError(
                f"{method} checkpoint: tensor {name!r} ({tensor.dtype}) was not consumed by "
                f"dequantization; flowlang loads {SUPPORTED}"
            )
    return plain


def _drop_static_scales(weights: Weights) -> Weights:
    dropped = [name for name in weights if name.endswith(STATIC_SCALES)]
    for name in dropped:
        del weights[name]
    if dropped:  # said once, so no one expects W8A8 numerics from a CPU engine
        log.warning(
            "dropped %d static activation/KV scales (e.g. %s): activations and the KV cache "
            "run in the engine's dtype, only the weights were quantized",
            len(dropped),
            dropped[0],
        )
    return weights


def _take(weights: Weights, name: str) -> torch.Tensor:
    try:
        return weights.pop(name)
    except KeyError:
        raise CheckpointError(f"quantized checkpoint has no tensor {name!r}") from None


def _layers(weights: Weights, suffix: str) -> list[str]:
    """The prefixes (`model.layers.0.mlp.up_proj.`) of the tensors named `<prefix><suffix>`,
    each checked not to carry a plain weight as well."""
    prefixes = sorted(name[: -len(suffix)] for name in weights if name.endswith("." + suffix))
    for prefix in prefixes:
        if prefix + "weight" in weights:
            raise CheckpointError(f"{prefix}weight and {prefix}{suffix} both in the checkpoint")
    return prefixes


def _compressed_tensors(weights: Weights, quant: dict) -> Weights:
    fmt = quant.get("format", "float-quantized")
    sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
    if fmt not in ("float-quantized", "naive-quantized") or sparsity != "dense":
        raise CheckpointError(
            f"compressed-tensors format {fmt!r} (sparsity {sparsity!r}) is not supported; "
            f"flowlang loads {SUPPORTED}"
        )
    blocks = {
        _ct_block(group.get("weights") or {}) for group in quant.get("config_groups", {}).values()
    }
    if len(blocks) > 1:
        raise CheckpointError(f"compressed-tensors groups with different blocks {blocks}")
    return _fp8(weights, "weight_scale", blocks.pop() if blocks else None)


def _ct_block(args: dict) -> tuple[int, int] | None:
    """The [rows, cols] each weight_scale covers where its shape alone does not say it."""
    if args.get("type") != "float" or args.get("num_bits") != 8 or not args.get("symmetric", True):
        raise CheckpointError(
            f"compressed-tensors weights {args} are not supported (FP8 e4m3, symmetric only); "
            f"flowlang loads {SUPPORTED}"
        )
    strategy = args.get("strategy", "tensor")
    if strategy == "block":
        return tuple(args["block_structure"])
    if strategy == "group":
        return (1, args["group_size"])
    if strategy in ("tensor", "channel"):
        return None  # the scale's shape says it: [] / [1], or [out, 1]
    raise CheckpointError(f"compressed-tensors weight strategy {strategy!r} is not supported")


def _fp8_blockwise(weights: Weights, quant: dict) -> Weights:
    block = quant.get("weight_block_size")
    return _fp8(weights, "weight_scale_inv", tuple(block) if block else None)


def _fp8(weights: Weights, scale_suffix: str, block: tuple[int, int] | None) -> Weights:
    """Each float8_e4m3fn `<layer>.weight` times its `<layer>.<scale_suffix>`, in fp32."""
    for name in [name for name, tensor in weights.items() if tensor.dtype == torch.float8_e4m3fn]:
        scale_name = name + scale_suffix.removeprefix("weight")
        scale = _expand(_take(weights, scale_name), weights[name].shape, block, scale_name)
        weights[name] = weights[name].float() * scale
    return weights


def _expand(
    scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None, name: str
) -> torch.Tensor:
    """A scale tensor made elementwise for a weight of `shape` (broadcast where it can be)."""
    if len(shape) != 2:
        raise CheckpointError(f"{name} scales a weight of shape {list(shape)}, not a matrix")
    rows, cols = shape
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(())
    if tuple(scale.shape) == (rows, 1):
        return scale
    if block is None:
        raise CheckpointError(f"{name} has shape {list(scale.shape)} for a weight {list(shape)}")
    bo, bi = block
    if tuple(scale.shape) != (-(-rows // bo), -(-cols // bi)):
        raise CheckpointError(
            f"{name} has shape {list(scale.shape)}; blocks {list(block)} of a weight "
            f"{list(shape)} need {[-(-rows // bo), -(-cols // bi)]}"
        )
    return scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> [..., n * 32 // bits] integers, value i of each int32 at bits
    i*bits.. (low bits first); the mask also undoes the sign of a top value >= 2**(bits-1)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.flatten(-2)


def _dequant(
    prefix: str, q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """W[in, out] = (q - z[g]) * s[g] for each input row's group g, as the engine's [out, in]."""
    if z.shape != s.shape or q.shape[1] != s.shape[1] or g_idx.shape != (q.shape[0],):
        raise CheckpointError(
            f"{prefix}: qweight {list(q.shape)} (unpacked), qzeros {list(z.shape)} (unpacked), "
            f"scales {list(s.shape)} and g_idx {list(g_idx.shape)} do not fit together"
        )
    if g_idx.numel() and not 0 <= int(g_idx.min()) <= int(g_idx.max()) < s.shape[0]:
        raise CheckpointError(f"{prefix}g_idx names groups outside 0..{s.shape[0] - 1}")
    # (q - z) is an exact small integer: one fp32 rounding, in the multiply
    return ((q - z[g_idx]).float() * s.float()[g_idx]).t().contiguous()


def _row_groups(in_features: int, group_size: int) -> torch.Tensor:
    """Each input row's group when groups are consecutive rows (-1: one group)."""
    return torch.arange(in_features) // (in_features if group_size == -1 else group_size)


def _awq(weights: Weights, quant: dict) -> Weights:
    version = str(quant.get("version", "gemm")).lower()
    bits = quant.get("bits", quant.get("w_bit"))  # transformers' name, AutoAWQ's name
    if version != "gemm" or bits != 4 or not quant.get("zero_point", True):
        raise CheckpointError(
            f"AWQ version {version!r} with bits={bits} and zero_point="
            f"{quant.get('zero_point', True)} is not supported; flowlang loads {SUPPORTED} "
            f"(gemv, marlin and exllama layouts pack differently)"
        )
    group_size = quant.get("group_size", quant.get("q_group_size", 128))
    for prefix in _layers(weights, "qweight"):
        qweight, qzeros = _take(weights, prefix + "qweight"), _take(weights, prefix + "qzeros")
        scales = _take(weights, prefix + "scales")
        q, z = _unpack_awq(qweight), _unpack_awq(qzeros)  # [in, out], [in / group, out]
        g_idx = _row_groups(q.shape[0], group_size)
        weights[prefix + "weight"] = _dequant(prefix, q, z, scales, g_idx)
    return weights


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's int32 [rows, out/8] -> [rows, out]: unpacked column 8c + i is nibble i of
    packed column c, which holds output 8c + AWQ_ORDER[i]; reordered to 8c + j."""
    order = torch.arange(packed.shape[1] * 8).view(-1, 8)[:, AWQ_UNDO_ORDER].flatten()
    return _unpack(packed, 4)[:, order]


def _gptq(weights: Weights, quant: dict) -> Weights:
    bits = quant.get("bits")
    fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
    if bits not in (4, 8) or fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"GPTQ with bits={bits} and format {fmt!r} is not supported; flowlang loads {SUPPORTED}"
        )
    zero_offset = 1 if fmt == "gptq" else 0  # v1 stores z - 1
    for prefix in _layers(weights, "qweight"):
        qweight, qzeros = _take(weights, prefix + "qweight"), _take(weights, prefix + "qzeros")
        scales = _take(weights, prefix + "scales")
        q = _unpack(qweight.t(), bits).t()  # packed along the input dim: [in, out]
        z = _unpack(qzeros, bits) + zero_offset  # [groups, out]
        if prefix + "g_idx" in weights:
            g_idx = _take(weights, prefix + "g_idx").long()
        elif quant.get("desc_act"):
            raise CheckpointError(f"act-order (desc_act) GPTQ checkpoint has no {prefix}g_idx")
        else:
            g_idx = _row_groups(q.shape[0], quant.get("group_size", 128))
        weights[prefix + "weight"] = _dequant(prefix, q, z, scales, g_idx)
    return weights


METHODS: dict[str, Callable[[Weights, dict], Weights]] = {
    "compressed-tensors": _compressed_tensors,
    "fp8": _fp8_blockwise,
    "awq": _awq,
    "gptq": _gptq,
}
