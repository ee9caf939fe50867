"""Any checkpoint quantized to GGUF blocks at load (EngineConfig.quantize): the quantized modes.

llama.cpp users quantize a model once with llama-quantize; SGLang and vLLM quantize at load
(`--quantization fp8`). Here a checkpoint's projections and its LM head (a tied head: the
embedding) are quantized at load to Q8_0, Q5_0, Q4_1 or Q4_0 by gguf-py's own quantizer,
llama.cpp's reference rounding, and handed to the model as blocks, as a GGUF file's are
(gguf_blocks.py): decode rows run on them through the native block GEMM. Each quantized weight
is replaced in the checkpoint by its exact dequantization, so that prefill (oneDNN over the
weights) and decode compute with the same values, as they do for a GGUF model.

A tensor whose rows are not whole blocks of 32 cannot be quantized (a CheckpointError names
it). Phi-3's fused q/k/v and gate/up tensors keep their weights as stored (no per-part names to
find); so do experts. Quantizing runs in numpy: about a second for SmolLM2-135M on 2 cores, a
few minutes for an 8B model.
"""

from __future__ import annotations

import torch

from runtime.model.gguf_blocks import PROJECTIONS, Blocks
from runtime.model.loader import CheckpointError
from runtime.model.native import kernels

GGML_TYPES = {
    "q8_0": kernels.GGML_Q8_0,
    "q5_0": kernels.GGML_Q5_0,
    "q4_1": kernels.GGML_Q4_1,
    "q4_0": kernels.GGML_Q4_0,
}


def quantized_names(weights: dict[str, torch.Tensor], num_layers: int, tied: bool) -> list[str]:
    """The checkpoint tensors the blocks replace: every projection stored by its own name, and
    the LM head's weight (a tied head's: the embedding)."""
    names = [
        name
        for layer in range(num_layers)
        for stem in PROJECTIONS
        if (name := f"model.layers.{layer}.{stem}.weight") in weights
    ]
    head = "lm_head.weight" if "lm_head.weight" in weights and not tied else None
    return [*names, head or "model.embed_tokens.weight"]


def quantize_checkpoint(
    weights: dict[str, torch.Tensor], num_layers: int, tied: bool, kind: str
) -> dict[str, Blocks]:
    """Blocks of `kind` (a QUANTIZE_TYPES name) for `quantized_names`, by checkpoint name;
    `weights` is changed in place: each of those tensors becomes its blocks' dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import QuantError, dequantize, quantize

    if not kernels.load_cpu_kernels().quant_gemm_supported():
        raise CheckpointError("quantize: this CPU lacks the AVX-512 VNNI/BF16 the block GEMM needs")
    ggml_type = GGMLQuantizationType(GGML_TYPES[kind])
    blocks: dict[str, Blocks] = {}
    for name in quantized_names(weights, num_layers, tied):
        weight = weights[name]
        try:
            raw = quantize(weight.float().numpy(), ggml_type)
        except QuantError as err:
            raise CheckpointError(f"quantize {kind}: {name} {tuple(weight.shape)}: {err}") from None
        weights[name] = torch.from_numpy(dequantize(raw, ggml_type))  # fp32: exact
        blocks[name] = (torch.from_numpy(raw), int(ggml_type))
    return blocks
