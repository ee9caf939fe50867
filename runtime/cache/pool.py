"""KV pool: per layer K and V tensors indexed by slot; the radix tree holds only slot indices.

A CPU pool is anonymous memory that the OS zero-fills on first touch, so only the rows written
become resident: a pool sized for a long session costs what the session has used so far, not
its full size at startup (torch.zeros would write, and so commit, every page at once).
"""

from __future__ import annotations

import math
import mmap

import torch


class KVPool:
    """K and V for `num_slots` tokens in every layer, plus `scratch_slots` rows after them.

    Scratch rows (slot ids num_slots, num_slots + 1, ...) are never handed out by the allocator:
    padded entries of a captured decode graph write their K/V there and attend to them.

    >>> pool = KVPool(num_layers=2, num_slots=16, num_kv_heads=1, head_dim=4)
    >>> pool.k[0].shape
    torch.Size([16, 1, 4])
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_slots: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots  # what the allocator hands out
        self.scratch_slot = num_slots  # the first scratch row (valid only if scratch_slots)
        self.scratch_slots = scratch_slots
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_slots + scratch_slots, num_kv_heads, head_dim)
        self._k = lazy_zeros(shape, dtype, self.device)
        self._v = lazy_zeros(shape, dtype, self.device)
        # per layer views: (num_slots + scratch_slots, num_kv_heads, head_dim)
        self.k = list(self._k.unbind(0))
        self.v = list(self._v.unbind(0))
        self.write_counts: torch.Tensor | None = None  # see track_writes

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together, scratch rows included (reserved, not all resident)."""
        return self._k.nbytes + self._v.nbytes

    def track_writes(self) -> torch.Tensor:
        """From now on count, per slot, the layer writes into it: (num_slots + scratch_slots,)
        int64. A copy made from some slots stays exact while their counts are unchanged."""
        if self.write_counts is None:
            size = self.num_slots + self.scratch_slots
            self.write_counts = torch.zeros(size, dtype=torch.int64, device=self.device)
        return self.write_counts

    def write(self, layer: int, slot_idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows (num_tokens, num_kv_heads, head_dim) at `slot_idx` (num_tokens,)."""
        self.k[layer].index_copy_(0, slot_idx, k)
        self.v[layer].index_copy_(0, slot_idx, v)
        self.count_writes(slot_idx, 1)

    def count_writes(self, slot_idx: torch.Tensor, num_layers: int) -> None:
        """Add `num_layers` layer writes to each of `slot_idx`'s counts (when tracked): what
        `write` does per layer, for rows written by other means (a tier's load, the fused
        decode layers)."""
        if self.write_counts is not None:
            self.write_counts.index_add_(0, slot_idx, torch.full_like(slot_idx, num_layers))

    def read_rows(self, slot_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slot_idx` (n,) in every layer: (num_layers, n, num_kv_heads, head_dim)
        each, copies (a lower KV tier keeps them after the slots are reused)."""
        idx = slot_idx.to(self.device)
        return self._k.index_select(1, idx), self._v.index_select(1, idx)

    def read_rows_into(self, slot_idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`read_rows` into `k` and `v` (num_layers, n, num_kv_heads, head_dim), contiguous
        (a host tier's row): one gather each on CPU."""
        idx = slot_idx.to(self.device)
        if self.device.type == "cpu":
            torch.index_select(self._k, 1, idx, out=k)
            torch.index_select(self._v, 1, idx, out=v)
        else:
            k.copy_(self._k.index_select(1, idx))
            v.copy_(self._v.index_select(1, idx))

    def write_rows(self, slot_idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every layer's K/V rows (num_layers, n, num_kv_heads, head_dim) at `slot_idx`
        (n,): KV loaded from a lower tier instead of computed."""
        idx = slot_idx.to(self.device)
        self._k.index_copy_(1, idx, k.to(self.device, non_blocking=True))
        self._v.index_copy_(1, idx, v.to(self.device, non_blocking=True))
        self.count_writes(idx, self.num_layers)


def lazy_zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A zero tensor; on CPU one whose pages become resident only when written."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private (not shared with a forked child), anonymous: zero pages committed on first write;
    # the tensor holds a reference to the mapping, which is unmapped when the tensor is freed
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)
