"""A GGUF model's projection and LM-head weights as stored, block bytes and all, for the decode
rows' block GEMM (csrc/quant_gemm.cpp; EngineConfig.gguf_blocks): Q8_0, Q4_0, Q4_1, Q5_0, Q4_K
and Q6_K, what the files people download (Q4_0, Q4_1, Q8_0, Q4_K_M) hold.

The checkpoint the engine loads is the GGUF dequantized to fp32 (registry.py converts it once);
this reads the raw blocks again from the source file and names them as that checkpoint does
(`model.layers.{i}.self_attn.q_proj.weight`, ...), through gguf-py's own tensor-name map.
llama and gemma3 files are read. In llama files the converter permuted q_proj's and k_proj's
rows for its RoPE layout, and transformers undoes that when it dequantizes
(LlamaTensorProcessor), so the same permutation is applied here to whole rows of bytes (blocks
run along the input dim). Other architectures, and tensors of other types, give no blocks: their
Linears keep the panel GEMM over the dequantized weight. That is a speed choice only; the math
is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from runtime.model.loader import CheckpointError
from runtime.model.native import kernels

# raw GGUF rows (out_features, bytes a row) as uint8, and their GGMLQuantizationType value
Blocks = tuple[torch.Tensor, int]

# the checkpoint tensors llama.py builds Linears of (per layer), by their HF names' stems
PROJECTIONS = tuple(f"self_attn.{x}_proj" for x in "qkvo") + tuple(
    f"mlp.{x}_proj" for x in ("gate", "up", "down")
)
# the LM head's weight, by GGUF name: its own, or the token embedding a tied head reads (the
# head streams vocab x hidden weights a token: on the default model as many as 8 of its layers)
HEAD_TENSORS = {"output.weight": "lm_head.weight", "token_embd.weight": "model.embed_tokens.weight"}
# the layout quant_pack packs each block type into (csrc/quant_gemm.cpp's format_of): parts of
# one Linear packed alike join by whole groups of GROUP_OUTPUTS rows into one packed weight
PACKED_LAYOUT = {
    kernels.GGML_Q4_0: kernels.GGML_Q4_1,
    kernels.GGML_Q4_1: kernels.GGML_Q4_1,
    kernels.GGML_Q5_0: kernels.GGML_Q8_0,
    kernels.GGML_Q8_0: kernels.GGML_Q8_0,
    kernels.GGML_Q4_K: kernels.GGML_Q4_K,
    kernels.GGML_Q6_K: kernels.GGML_Q6_K,
}
BLOCK_TYPES = tuple(PACKED_LAYOUT)
GROUP_OUTPUTS = 16  # quant_gemm.cpp's kGroup
# the GGUF architectures read (general.architecture -> gguf-py's MODEL_ARCH member): llama
# (SmolLM2, Llama, Mistral's files) and gemma3, whose rows the converter did not permute
ARCHITECTURES = {"llama": "LLAMA", "gemma3": "GEMMA3"}


def source_gguf(model: str) -> Path | None:
    """The GGUF file a model comes from: a `.gguf` path itself, a registry name's source file
    (where it is still here), else None (a folder or hub id: no blocks to read)."""
    from runtime.model.registry import source_gguf as registry_gguf

    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    return registry_gguf(model)


def configured_blocks(model: str, setting: bool | None, device: torch.device) -> dict[str, Blocks]:
    """The blocks EngineConfig.gguf_blocks asks for: True, the model's (`model_blocks`: an error
    where there are none); False, none; None (the default), the model's where it is a GGUF of a
    read architecture on a CPU whose kernels run the block GEMM, else none."""
    if setting is not None:
        return model_blocks(model) if setting else {}
    path = source_gguf(model)
    if device.type != "cpu" or path is None:
        return {}
    try:
        supported = kernels.load_cpu_kernels().quant_gemm_supported()
    except kernels.KernelBuildError:  # reported once by the kernels' loader; the torch path runs
        return {}
    return read_blocks(path) if supported else {}


def model_blocks(model: str) -> dict[str, Blocks]:
    """`read_blocks` of the model's source GGUF. A model with no GGUF here, or one with no
    projection of a BLOCK_TYPES type in an ARCHITECTURES file, is a CheckpointError:
    `gguf_blocks` would change nothing, and a setting is never silently ignored."""
    from gguf import GGMLQuantizationType

    path = source_gguf(model)
    if path is None:
        raise CheckpointError(
            f"gguf_blocks needs a GGUF model (a .gguf file, or a registry name whose GGUF is in "
            f"the cache); {model!r} has none here: run it without gguf_blocks"
        )
    if not kernels.load_cpu_kernels().quant_gemm_supported():
        raise CheckpointError(
            "gguf_blocks: this CPU lacks the AVX-512 VNNI/BF16 the block GEMM needs"
        )
    blocks = read_blocks(path)
    if not blocks:
        raise CheckpointError(
            f"gguf_blocks: {path.name} has no projection weights of a block type the GEMM takes "
            f"({', '.join(GGMLQuantizationType(t).name for t in BLOCK_TYPES)}) in an "
            f"architecture it reads ({', '.join(ARCHITECTURES)}): run it without gguf_blocks"
        )
    return blocks


def read_blocks(path: str | Path) -> dict[str, Blocks]:
    """Checkpoint name -> the file's block bytes for each projection weight and the LM head's
    (or the token embedding's, which a tied head reads), rows in the checkpoint's order, where
    the block GEMM takes their type; {} for a file of an architecture not in ARCHITECTURES."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        return {}
    num_layers = int(_field(reader, f"{arch}.block_count"))
    heads = {}  # projections whose rows llama.cpp's converter permuted: stem -> heads
    if arch == "llama":
        heads = {
            "self_attn.q_proj": int(_field(reader, "llama.attention.head_count")),
            "self_attn.k_proj": int(_field(reader, "llama.attention.head_count_kv")),
        }
    name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHITECTURES[arch]), num_layers)
    hf_names = {}  # GGUF name -> (checkpoint name, projection stem)
    for layer in range(num_layers):
        for stem in PROJECTIONS:
            hf = f"model.layers.{layer}.{stem}"
            hf_names[f"{name_map.get_name(hf)}.weight"] = (f"{hf}.weight", stem)
    hf_names.update({gguf_name: (hf, hf) for gguf_name, hf in HEAD_TENSORS.items()})
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


def head_blocks(blocks: dict[str, Blocks], tied: bool) -> list[Blocks] | None:
    """The LM head's blocks: its own weight's, or a tied head's the embedding's."""
    own = "lm_head.weight"
    return linear_blocks(
        blocks, ["model.embed_tokens.weight" if own not in blocks and tied else own]
    )


def linear_blocks(blocks: dict[str, Blocks], names: Sequence[str]) -> list[Blocks] | None:
    """The blocks of a Linear whose weight is these tensors' rows concatenated in this order,
    part by part: when every part has blocks, all of one packed layout (Q5_0 beside Q8_0, as
    Q4_K_M files mix them in q/k/v), and each part but the last whole groups of rows; else
    None (the Linear keeps the panel)."""
    parts = [blocks.get(name) for name in names]
    if not parts or any(p is None for p in parts):
        return None
    if len({PACKED_LAYOUT[p[1]] for p in parts}) != 1:
        return None
    if any(p[0].shape[0] % GROUP_OUTPUTS for p in parts[:-1]):
        return None
    return parts


def _field(reader, key: str):
    """A metadata value of the GGUF file (str or number); a KeyError names a missing one."""
    return reader.fields[key].contents()
