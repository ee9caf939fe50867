"""Shared prefixes' K/V packed for the native flash kernel, kept across forward passes.

A cascade attends its shared prefix (W1's 2k-token system prompt and few-shot block) in every
layer of every step while its members decode. The flash kernel reads K in tiles of 16 keys per
feature and V in key pairs, so each call used to gather the prefix's rows out of the pool and
repack them: at 64 decodes over a 2k prefix that was a quarter of the call in bf16 and half in
fp32. Packed once per layer and kept, a prefix costs its packing once per stay in the cache.

A packed copy is exact while none of its slots has been written since: the pool counts writes
per slot (`KVPool.track_writes`), and an entry is used only when those counts are unchanged
(a slot freed and reused for another token is written before anyone attends to it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from runtime.cache.pool import KVPool


class PackedPrefix:
    """One prefix's slots and, per layer, its packed K and V (made on first use)."""

    def __init__(self, slots: torch.Tensor, writes: torch.Tensor, num_layers: int) -> None:
        self.slots = slots  # (length,) int64, contiguous
        self.writes = writes  # (length,) the pool's write counts when this entry was made
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self.nbytes = 0

    @property
    def length(self) -> int:
        return self.slots.numel()


class PackedPrefixes:
    """Packed prefixes keyed by their slot lists; least recently used dropped past `max_bytes`
    (entries used by the current step are kept even past it: the step needs them)."""

    def __init__(self, pool: KVPool, kernels: Any, max_bytes: int) -> None:
        self.pool = pool
        self._kernels = kernels
        self._writes = pool.track_writes()
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, PackedPrefix] = OrderedDict()
        self._in_use: set[bytes] = set()
        self.packs = 0  # layer packings done (a deterministic counter for tests)

    def begin_step(self) -> None:
        """A new forward pass: last step's entries may go now, beyond the budget."""
        self._in_use = set()
        self._shrink()

    def get(self, slots: torch.Tensor) -> PackedPrefix:
        """The entry for these slots, made afresh when new or when any slot was rewritten."""
        slots = slots.contiguous()
        key = slots.numpy().tobytes()
        writes = self._writes[slots]
        entry = self._entries.get(key)
        if entry is None or not torch.equal(entry.writes, writes):
            if entry is not None:
                self._entries.pop(key)
            entry = PackedPrefix(slots, writes, self.pool.num_layers)
            self._entries[key] = entry
        self._entries.move_to_end(key)
        self._in_use.add(key)
        return entry

    def packed(self, entry: PackedPrefix, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_packed, v_packed) of `entry` at `layer`, packed from the pool on first use."""
        packed = entry.layers[layer]
        if packed is None:
            packed = self._kernels.flash_pack(self.pool.k[layer], self.pool.v[layer], entry.slots)
            entry.layers[layer] = packed
            entry.nbytes += sum(t.numel() * t.element_size() for t in packed)
            self.packs += 1
            self._shrink()
        return packed

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def _shrink(self) -> None:
        total = self.nbytes
        for key in list(self._entries):
            if total <= self.max_bytes:
                return
            if key in self._in_use:
                continue
            total -= self._entries.pop(key).nbytes

    def check_integrity(self) -> None:
        for key, entry in self._entries.items():
            assert key == entry.slots.numpy().tobytes(), "an entry filed under other slots"
            assert entry.writes.shape == entry.slots.shape
            packed = [p for p in entry.layers if p is not None]
            assert entry.nbytes == sum(t.numel() * t.element_size() for p in packed for t in p)
        assert self._in_use <= set(self._entries), "an entry in use was dropped"
