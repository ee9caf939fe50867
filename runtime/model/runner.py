"""ModelRunner: a model, its KV pool and an attention backend; one forward per ForwardBatch."""

from __future__ import annotations

import os
from typing import Any

import torch

from runtime.cache.pool import KVPool
from runtime.config import EngineConfig
from runtime.errors import UsageError
from runtime.model.arch import ModelArch
from runtime.model.attention import make_attention_backend
from runtime.model.batch import ForwardBatch
from runtime.model.cuda_graph import DecodeGraphs
from runtime.model.gguf_blocks import Blocks
from runtime.model.linear import Linear, decode_shaped, routed_rows
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
    >>> runner = ModelRunner(arch, weights, 4096, EngineConfig(dtype="bfloat16"))  # doctest: +SKIP
    """

    def __init__(
        self,
        arch: ModelArch,
        weights: dict[str, torch.Tensor],
        num_slots: int,
        config: EngineConfig | None = None,
        blocks: dict[str, Blocks] | None = None,
    ) -> None:
        """`blocks`: GGUF block bytes of these very weights, by checkpoint name, for the decode
        rows (gguf_blocks.configured_blocks, read by whoever loaded the weights)."""
        config = config or EngineConfig()
        self.arch = arch
        self.batch_invariant = config.batch_invariant
        self.dtype = parse_dtype(config.dtype)
        self.device = _checked_device(config.device)
        self.model = LlamaModel(arch, weights, self.dtype, self.device, blocks)
        if config.batch_invariant or config.speculative != "off":
            # verified drafts and invariant batches need each row summed as it is alone
            for linear in self.model.linears():
                linear.block_rows_alike = True
        if config.quantize_activations:
            quantize_activations(self.model.linears())
        # decode graphs on CUDA for dense models (the experts' routing syncs with the host)
        graphs = not config.disable_cuda_graph and self.device.type == "cuda"
        graphs = graphs and arch.num_experts == 0
        self.pool = KVPool(
            arch.num_layers,
            num_slots,
            arch.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.device,
            scratch_slots=config.page_size if graphs else 0,  # where graph padding writes
        )
        self.attention = make_attention_backend(
            config.attention_backend,
            self.pool,
            arch.sliding_windows,
            arch.num_heads,
            config.page_size,
            arch.attn_softcap,
            config.batch_invariant,
        )
        self.decode_graphs: DecodeGraphs | None = None
        if graphs and self.attention.supports_decode_graphs:
            self.decode_graphs = DecodeGraphs(
                self.model, self.attention, self.pool, config.cuda_graph_max_batch_size
            )
        self.num_forward_passes = 0

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, num_slots: int, **settings: Any
    ) -> ModelRunner:
        """A runner for a local checkpoint; `settings` are EngineConfig fields (dtype, ...)."""
        checkpoint = load_checkpoint(path)
        config = EngineConfig(model=str(path), **settings)
        return cls(ModelArch.from_hf(checkpoint.hf_config), checkpoint.weights, num_slots, config)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits (num_logit_rows, vocab) after writing the batch's new K/V into the pool."""
        self.num_forward_passes += 1
        if self.decode_graphs is not None and self.decode_graphs.can_run(batch):
            return self.decode_graphs.run(batch)
        self.attention.plan(batch)
        routes = routed_rows if self.batch_invariant else decode_shaped
        with routes(batch.extend_lens):
            return self.model.forward(batch, self.attention)

    @property
    def num_graph_replays(self) -> int:
        return 0 if self.decode_graphs is None else self.decode_graphs.num_replays


def _checked_device(name: str) -> torch.device:
    """The torch device `name`, or a UsageError when this machine has no such device."""
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise UsageError(
                f"device {name!r}: torch {torch.__version__} sees {count} CUDA device(s) here; "
                f"use --device cpu{' or another index' if count else ''}"
            )
    return device


def quantize_activations(linears: list[Linear]) -> None:
    """Every row of each Linear on blocks rounds its activations to int8 per block (the config
    field quantize_activations); an engine with no blocks is refused, not run as asked for
    something it does not do."""
    on_blocks = [linear for linear in linears if linear.quant is not None]
    if not on_blocks:
        raise UsageError(
            "quantize_activations: no weights on GGUF blocks here (a GGUF model with "
            "gguf_blocks, or quantize=..., on a CPU with AVX-512 VNNI/BF16)"
        )
    for linear in on_blocks:
        linear.block_quantize_x = True
