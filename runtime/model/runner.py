"""ModelRunner: a model, its KV pool and an attention backend; one forward per ForwardBatch."""

from __future__ import annotations

import os

import torch

from runtime.cache.pool import KVPool
from runtime.model.arch import ModelArch
from runtime.model.attention import make_attention_backend
from runtime.model.batch import ForwardBatch
from runtime.model.llama import LlamaModel
from runtime.model.loader import load_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


class ModelRunner:
    """Runs ForwardBatches of a Llama-family model over a slot-indexed KV pool.

    >>> runner = ModelRunner.from_checkpoint("path/to/model", num_slots=4096)  # doctest: +SKIP
    """

    def __init__(
        self,
        arch: ModelArch,
        weights: dict[str, torch.Tensor],
        num_slots: int,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        attention_backend: str = "auto",
        page_size: int = 1,
    ) -> None:
        self.arch = arch
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        self.model = LlamaModel(arch, weights, self.dtype, self.device)
        self.pool = KVPool(
            arch.num_layers, num_slots, arch.num_kv_heads, arch.head_dim, self.dtype, self.device
        )
        self.attention = make_attention_backend(
            attention_backend, self.pool, arch.sliding_windows, arch.num_heads, page_size
        )
        self.num_forward_passes = 0

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, num_slots: int, **kwargs) -> ModelRunner:
        checkpoint = load_checkpoint(path)
        return cls(ModelArch.from_hf(checkpoint.hf_config), checkpoint.weights, num_slots, **kwargs)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits (num_logit_rows, vocab) after writing the batch's new K/V into the pool."""
        self.attention.plan(batch)
        self.num_forward_passes += 1
        return self.model.forward(batch, self.attention)
