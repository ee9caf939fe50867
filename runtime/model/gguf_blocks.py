"""A GGUF model's Q8_0 / Q4_1 projection weights as stored, block bytes and all, for the decode
rows' block GEMM (csrc/quant_gemm.cpp; EngineConfig.gguf_blocks).

The checkpoint the engine loads is the GGUF dequantized to fp32 (registry.py converts it once);
this reads the raw blocks again from the source file and names them as that checkpoint does
(`model.layers.{i}.self_attn.q_proj.weight`, ...), through gguf-py's own tensor-name map. Only
llama-architecture files are read: llama.cpp's converter permuted q_proj's and k_proj's rows for
its RoPE layout, and transformers undoes that when it dequantizes (LlamaTensorProcessor), so the
same permutation is applied here to whole rows of bytes (blocks run along the input dim). Other
architectures, and tensors of other types, give no blocks: their Linears keep the panel GEMM
over the dequantized weight. That is a speed choice only; the math is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from runtime.model.loader import CheckpointError
from runtime.model.native.kernels import GGML_Q4_1, GGML_Q8_0

# raw GGUF rows (out_features, bytes a row) as uint8, and their GGMLQuantizationType value
Blocks = tuple[torch.Tensor, int]

# the checkpoint tensors llama.py builds Linears of (per layer), by their HF names' stems
PROJECTIONS = tuple(f"self_attn.{x}_proj" for x in "qkvo") + tuple(
    f"mlp.{x}_proj" for x in ("gate", "up", "down")
)
BLOCK_TYPES = (GGML_Q8_0, GGML_Q4_1)


def source_gguf(model: str) -> Path | None:
    """The GGUF file a model comes from: a `.gguf` path itself, a registry name's source file
    (where it is still here), else None (a folder or hub id: no blocks to read)."""
    from runtime.model.registry import source_gguf as registry_gguf

    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    return registry_gguf(model)


def model_blocks(model: str) -> dict[str, Blocks]:
    """`read_blocks` of the model's source GGUF. A model with no GGUF here, or one with no
    Q8_0 / Q4_1 projection of the llama architecture, is a CheckpointError: `gguf_blocks`
    would change nothing, and a setting is never silently ignored."""
    path = source_gguf(model)
    if path is None:
        raise CheckpointError(
            f"gguf_blocks needs a GGUF model (a .gguf file, or a registry name whose GGUF is in "
            f"the cache); {model!r} has none here: run it without gguf_blocks"
        )
    from runtime.model.native.kernels import load_cpu_kernels

    if not load_cpu_kernels().quant_gemm_supported():
        raise CheckpointError(
            "gguf_blocks: this CPU lacks the AVX-512 VNNI/BF16 the block GEMM needs"
        )
    blocks = read_blocks(path)
    if not blocks:
        raise CheckpointError(
            f"gguf_blocks: {path.name} has no Q8_0 or Q4_1 projection weights of the llama "
            "architecture to run on their blocks: run it without gguf_blocks"
        )
    return blocks


def read_blocks(path: str | Path) -> dict[str, Blocks]:
    """Checkpoint name -> the file's Q8_0 / Q4_1 bytes for each projection weight, rows in the
    checkpoint's order; {} for a file that is not of the llama architecture."""
    import gguf

    reader = gguf.GGUFReader(path)
    if _field(reader, "general.architecture") != "llama":
        return {}
    num_layers = int(_field(reader, "llama.block_count"))
    heads = {
        "self_attn.q_proj": int(_field(reader, "llama.attention.head_count")),
        "self_attn.k_proj": int(_field(reader, "llama.attention.head_count_kv")),
    }
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    hf_names = {}  # GGUF name -> (checkpoint name, projection stem)
    for layer in range(num_layers):
        for stem in PROJECTIONS:
            hf = f"model.layers.{layer}.{stem}"
            hf_names[f"{name_map.get_name(hf)}.weight"] = (f"{hf}.weight", stem)
    blocks: dict[str, Blocks] = {}
    for tensor in reader.tensors:
        if tensor.name not in hf_names or int(tensor.tensor_type) not in BLOCK_TYPES:
            continue
        name, stem = hf_names[tensor.name]
        rows = np.array(tensor.data)  # a copy of the memory-mapped (out, bytes a row) uint8
        if stem in heads:
            rows = unpermute_rows(rows, heads[stem])
        blocks[name] = (torch.from_numpy(rows), int(tensor.tensor_type))
    return blocks


def unpermute_rows(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (each head's rows interleaved as pairs, for its
    RoPE) exactly as transformers' LlamaTensorProcessor._reverse_permute_weights does."""
    half = rows.shape[0] // num_heads // 2
    permuted = rows.reshape(num_heads, half, 2, *rows.shape[1:]).swapaxes(2, 1)
    return np.ascontiguousarray(permuted.reshape(rows.shape))


def fused_blocks(blocks: dict[str, Blocks], names: Sequence[str]) -> Blocks | None:
    """The blocks of a Linear whose weight is these tensors' rows concatenated in this order:
    when every part has blocks of one type, else None (the Linear keeps the panel)."""
    parts = [blocks.get(name) for name in names]
    if not parts or any(p is None for p in parts) or len({p[1] for p in parts}) != 1:
        return None
    return torch.cat([p[0] for p in parts]), parts[0][1]


def _field(reader, key: str):
    """A metadata value of the GGUF file (str or number); a KeyError names a missing one."""
    return reader.fields[key].contents()
