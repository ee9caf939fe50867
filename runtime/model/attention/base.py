"""The attention backend contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from runtime.cache.pool import KVPool
from runtime.model.batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention over the KV pool for one ForwardBatch at a time.

    `plan(batch)` runs once per forward (index and mask building, kernel planning); then
    `forward(layer, q, k, v)` runs per layer: it writes the new K/V rows into the pool at
    `batch.out_slots` and returns attention over each sequence's full KV (cached prefix + new),
    causal by position. It mutates the pool and nothing else.
    """

    name: str
    supports_decode_graphs = False  # plans a captured decode graph's batch in static buffers

    def __init__(
        self,
        pool: KVPool,
        sliding_windows: tuple[int | None, ...],
        softcap: float | None = None,
    ) -> None:
        self.pool = pool
        self.sliding_windows = sliding_windows
        self.softcap = softcap  # scores -> softcap * tanh(scores / softcap) (Gemma 2)

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata shared by every layer."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q (num_tokens, num_heads, head_dim), k/v (num_tokens, num_kv_heads, head_dim)
        -> (num_tokens, num_heads * head_dim)."""

    def fused_decode_step(self) -> Any:
        """This forward's attention as one paged-decode call per layer that the fused decode
        layers (runtime/model/fused_decode.py) can make themselves, when `plan` found nothing
        else to do; None here: every layer goes through `forward`."""
        return None

    def prepare_decode_graphs(self, batch_sizes: tuple[int, ...], max_seq_len: int) -> None:
        """Static per-size planning state for decode graphs (runtime/model/cuda_graph.py);
        none here: the eager stand-in plans as usual."""
        return None

    def plan_graph_decode(self, batch: ForwardBatch, out_slots: torch.Tensor) -> None:
        """Plan a padded pure-decode batch of a captured size; new K/V go to `out_slots`, the
        static device copy of `batch.out_slots`. Here: an ordinary plan (an eager stand-in)."""
        self.plan(batch)
