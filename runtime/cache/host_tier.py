"""Host memory below the device pool (L2): chunk rows, LRU, with holds for known readers.

`NoHostTier` is the same interface for a configuration without host memory: it holds nothing
and takes nothing, so the tiers never ask whether there is an L2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from runtime.cache.chunks import TierLayout
from runtime.cache.pool import lazy_zeros


class HostTier:
    """`capacity_chunks` chunk rows in host memory (pinned when the pool is on CUDA), LRU.

    A path's chunks are touched leaf to root, so a parent is always fresher than its
    children and eviction goes leaf-first, as in the tree. Chunks prefetched for a known
    reader are *held*: evicted only when nothing else is left, until read (at most half the
    rows; beyond that the oldest hold lapses), so demotions do not push them out first."""

    def __init__(self, layout: TierLayout, capacity_chunks: int, pin_memory: bool) -> None:
        shape = (capacity_chunks, *layout.chunk_shape)
        if pin_memory:
            self.data = torch.empty(shape, dtype=layout.dtype, pin_memory=True)
        else:
            self.data = lazy_zeros(shape, layout.dtype)
        self.capacity_chunks = capacity_chunks
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # not held; oldest first
        self._held: OrderedDict[bytes, int] = OrderedDict()  # held; oldest hold first
        self._free = list(range(capacity_chunks - 1, -1, -1))

    def __contains__(self, name: bytes) -> bool:
        return name in self._rows or name in self._held

    def __len__(self) -> int:
        return len(self._rows) + len(self._held)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def row(self, name: bytes) -> int | None:
        row = self._rows.get(name)
        return row if row is not None else self._held.get(name)

    def items(self) -> list[tuple[bytes, int]]:
        """(chunk name, row) of every chunk here, the evictable oldest first."""
        return [*self._rows.items(), *self._held.items()]

    def touch(self, names: Sequence[bytes]) -> None:
        """Mark a path's chunks (root first in `names`) used, the root freshest; a held
        chunk that is read is held no more."""
        for name in reversed(names):
            row = self._held.pop(name, None)
            if row is not None:
                self._rows[name] = row
            if name in self._rows:
                self._rows.move_to_end(name)

    def hold(self, name: bytes) -> None:
        """Keep `name` until it is read (a prefetch for a known reader)."""
        row = self._rows.pop(name, None)
        if row is None:
            return
        self._held[name] = row
        if len(self._held) > self.capacity_chunks // 2:
            lapsed, row = self._held.popitem(last=False)
            self._rows[lapsed] = row
            self._rows.move_to_end(lapsed, last=False)  # its reader is late: it goes first

    def take(self, name: bytes) -> tuple[int, tuple[bytes, int] | None]:
        """A row for `name` (new, freshest) and the (name, row) it displaced, if any: the
        caller copies that row out before writing the new one."""
        if self._free:
            row = self._free.pop()
            self._rows[name] = row
            return row, None
        victims = self._rows if self._rows else self._held
        victim, row = victims.popitem(last=False)
        self._rows[name] = row
        return row, (victim, row)

    def check_integrity(self) -> None:
        rows = [*self._rows.values(), *self._held.values()]
        assert not self._rows.keys() & self._held.keys(), "a chunk both held and not"
        assert len(set(rows)) == len(rows), "two chunks share a host row"
        assert not set(rows) & set(self._free), "a host row is both used and free"
        assert len(rows) + len(self._free) == self.capacity_chunks, "host rows lost"
        assert len(self._held) <= self.capacity_chunks // 2, "too many held chunks"

    def takes(self, name: bytes) -> bool:
        """Whether storing `name` here would add it (it is not here yet)."""
        return name not in self


class NoHostTier:
    """No host memory: nothing is here, nothing is taken, nothing is held."""

    capacity_chunks = 0
    num_held = 0

    def __contains__(self, name: bytes) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def row(self, name: bytes) -> int | None:
        return None

    def items(self) -> list[tuple[bytes, int]]:
        return []

    def touch(self, names: Sequence[bytes]) -> None:
        pass

    def hold(self, name: bytes) -> None:
        pass

    def takes(self, name: bytes) -> bool:
        return False

    def check_integrity(self) -> None:
        pass
