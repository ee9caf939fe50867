"""What lies below the device pool, as the KV manager sees it: one protocol (`LowerTiers`)
for probing, loading, storing, prefetching and persisting KV, its units (`TierExtent`,
`TierCounters`), and `NoTiers`, the same protocol for an engine with no lower tier (the
`NullCache` lesson one layer down: callers never ask whether there are tiers). `KVTiers`
(tiers.py) is the implementation with host memory and/or a disk directory.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from runtime.cache.chunks import TierView


@dataclass(frozen=True)
class TierExtent:
    """How far the lower tiers continue a device match: chunks `first_chunk`.. named
    `names`, in L2 (`in_host[i]`) or only in L3, then maybe a partial chunk of
    `tail_tokens` tokens in L2 (`tail`); `start` is where the device match ends."""

    start: int
    first_chunk: int
    names: tuple[bytes, ...]
    in_host: tuple[bool, ...]
    chunk_tokens: int
    tail: bytes | None = None
    tail_tokens: int = 0

    @property
    def end(self) -> int:
        end = (self.first_chunk + len(self.names)) * self.chunk_tokens + self.tail_tokens
        return max(end, self.start)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def within(self, num_tokens: int) -> TierExtent:
        """The longest head of this extent, in whole chunks (and the tail if all of it
        fits), that is at most `num_tokens`."""
        if self.num_tokens <= num_tokens:
            return self
        c = self.chunk_tokens
        num_chunks = min(len(self.names), (self.start + num_tokens) // c - self.first_chunk)
        num_chunks = max(0, num_chunks)
        return TierExtent(
            self.start, self.first_chunk, self.names[:num_chunks], self.in_host[:num_chunks], c
        )


@dataclass
class TierCounters:
    demoted_tokens: int = 0  # L1 evictions kept below (chunks not already there)
    loaded_host_tokens: int = 0
    loaded_disk_tokens: int = 0
    prefetched_chunks: int = 0  # L3 -> L2 (or the staging area) ahead of admission
    load_seconds: float = 0.0  # on the admission path (the step waits for it)
    prefetch_seconds: float = 0.0  # reading chunk files on the prefetch thread (nobody waits)
    writes_inline: int = 0  # L3 writes made on the caller's thread: the writer was behind
    errors: int = 0  # unexpected failures below the pool (see KVTiers._failed)


class LowerTiers(Protocol):
    """What the KV manager, the scheduler and the engine use of the tiers below the pool."""

    write_policy: str  # config.KV_WRITE_POLICIES
    hold_budget_chunks: int  # chunks that may be held or staged for known readers at once
    keeps_evicted: bool  # whether what the tree evicts is worth demoting here

    def extent(
        self, namespace: Hashable, ids: Sequence[int], start: int, limit: int, memo=None
    ) -> TierExtent: ...
    def ready(self, extent: TierExtent) -> bool: ...
    def load(self, extent: TierExtent, slots: torch.Tensor) -> int: ...
    def demote(self, namespace: Hashable, path: tuple[int, ...], start: int, slots) -> None: ...
    def store(self, namespace: Hashable, ids: Sequence[int], start: int, slots, memo) -> None: ...
    def prefetch(self, extent: TierExtent, budget_chunks: int) -> int: ...
    def persist(self, paths: Iterable[tuple[Hashable, Sequence[int], torch.Tensor]]) -> int: ...
    def flush_events(self) -> None: ...
    def lower_snapshot(self) -> list[tuple[str, tuple[str, ...]]]: ...
    def stats(self) -> dict[str, float]: ...
    def describe(self) -> str | None: ...
    def view(self) -> TierView | None: ...
    def check_integrity(self) -> None: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...


class NoTiers:
    """No lower tier: nothing continues a device match, nothing is kept when evicted."""

    write_policy = "write_back"  # (nothing is written through)
    hold_budget_chunks = 0
    keeps_evicted = False  # the tree need not even compute an evicted leaf's path

    def extent(
        self, namespace: Hashable, ids: Sequence[int], start: int, limit: int, memo=None
    ) -> TierExtent:
        return TierExtent(start, 0, (), (), 1)

    def ready(self, extent: TierExtent) -> bool:
        return True

    def load(self, extent: TierExtent, slots: torch.Tensor) -> int:
        return 0

    def demote(self, namespace: Hashable, path: tuple[int, ...], start: int, slots) -> None:
        pass

    def store(self, namespace: Hashable, ids: Sequence[int], start: int, slots, memo) -> None:
        pass

    def prefetch(self, extent: TierExtent, budget_chunks: int) -> int:
        return 0

    def persist(self, paths: Iterable[tuple[Hashable, Sequence[int], torch.Tensor]]) -> int:
        return 0

    def flush_events(self) -> None:
        pass

    def lower_snapshot(self) -> list[tuple[str, tuple[str, ...]]]:
        return []

    def stats(self) -> dict[str, float]:
        return {}  # no tier, no kv_* series (as without tiers before)

    def describe(self) -> str | None:
        return None

    def view(self) -> TierView | None:
        return None

    def check_integrity(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


NO_TIERS = NoTiers()  # stateless: one serves every engine without lower tiers
