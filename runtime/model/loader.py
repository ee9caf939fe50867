"""Checkpoints: a Hugging Face folder (config.json, safetensors, tokenizer) or a GGUF file.

transformers parses configs, tokenizers, chat templates and GGUF metadata; the `gguf` package
dequantizes GGUF tensors (through transformers' GGUF reader, which also undoes llama.cpp's Q/K
permutation). A GGUF file is best converted once to a folder (`convert_gguf`), which reloads in
about a second. A folder whose config.json has a `quantization_config` (FP8, AWQ, GPTQ) is
dequantized to plain fp32 weights as it loads (runtime/model/quantized.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.errors import UsageError


class CheckpointError(UsageError, ValueError):
    """A checkpoint path that cannot be loaded; the message says what is missing."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    hf_config: Any  # transformers PretrainedConfig
    weights: dict[str, torch.Tensor]


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Config and weights from a Hugging Face folder or a .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        config, weights = _read_gguf(path)
        return Checkpoint(path, config, weights)
    return Checkpoint(path, load_config(path), _plain_weights(path, _read_safetensors(path)))


def load_config(path: str | os.PathLike) -> Any:
    """The transformers config of a folder or GGUF file."""
    from transformers import AutoConfig

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_config(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a model folder: no config.json")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer (with its chat template) of a folder or GGUF file."""
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize a GGUF file into a folder: config.json, model.safetensors, tokenizer files."""
    from safetensors.torch import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config, weights = _read_gguf(gguf_path)
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in weights.items()}, out_dir / "model.safetensors")
    config.save_pretrained(out_dir)
    load_tokenizer(gguf_path).save_pretrained(out_dir)
    return out_dir


WEIGHT_SUFFIXES = frozenset({".safetensors", ".gguf", ".bin", ".pt"})


def checkpoint_digest(path: str | os.PathLike) -> str:
    """A digest of a checkpoint's weights' bytes (every weight file, by relative name) and its
    config.json files: what the disk tier's KV belongs to. Each file's digest is cached by its
    stat, ctime and inode included, so a restart reads no weights twice, and weights changed
    in place, even to the same size and mtime, get a new one (ctime cannot be set back)."""
    root = Path(path)
    files = sorted(root.rglob("*")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        name = file.relative_to(root) if root.is_dir() else file.name
        if file.is_file() and file.suffix in WEIGHT_SUFFIXES:
            digest.update(f"{name}:{_file_digest(file)}\n".encode())
        elif file.name == "config.json":
            digest.update(f"{name}:".encode() + file.read_bytes() + b"\n")
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    """sha256 of a file's bytes (~0.4 s for SmolLM2-135M's 538 MB), remembered per stat."""
    from runtime.model.registry import cache_dir

    record = cache_dir() / "weight-digests" / f"{_path_key(path)}.json"
    stamp = _stamp(path)
    try:
        cached = json.loads(record.read_text())
        if cached["stat"] == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: compute it
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if _stamp(path) == stamp:  # not changed while read: worth remembering
        _remember_digest(record, {"stat": stamp, "sha256": digest.hexdigest()})
    return digest.hexdigest()


def _stamp(path: Path) -> list[int]:
    info = path.stat()
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _path_key(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]


def _remember_digest(record: Path, entry: dict) -> None:
    """Best effort: a read-only cache only costs the digest again next time."""
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, record)
    except OSError:
        tmp.unlink(missing_ok=True)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(folder / name))
    return weights


def _plain_weights(folder: Path, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights as an unquantized checkpoint has them: a quantized one's dequantized."""
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not quant:
        return weights
    from runtime.model.quantized import dequantize  # it imports CheckpointError from here

    return dequantize(weights, quant)


def _gguf_config(path: Path) -> Any:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    parsed = {k: v for k, v in parsed.items() if not k.startswith("_")}
    return AutoConfig.for_model(**parsed)


def _read_gguf(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = _gguf_config(path)
    with torch.device("meta"):  # only for the tensor-name map; allocates nothing
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    weights = {k: v.to(torch.float32) for k, v in parsed["tensors"].items()}
    return config, weights
