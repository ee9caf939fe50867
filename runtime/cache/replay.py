"""Replay a recorded cache access trace through a RadixCache of a given capacity, under any
eviction policy or the offline optimum for leaf-first eviction (Belady: evict the candidate
leaf whose next use is farthest, known from the rest of the trace; oracle.py).

Trace events (EngineConfig.record_trace): ("access", namespace, ids, match_limit) when a
request is admitted, ("insert", namespace, ids) when computed tokens enter the tree. The
replay is sequential (no concurrency, no locks beyond the access itself), so absolute hit
rates differ a little from the engine's; policies compare fairly on the same trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.oracle import OracleMarks
from runtime.cache.policy_base import NoMarks
from runtime.cache.radix import RadixCache
from runtime.prefix import union_prefix_tokens


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity: int
    hit_tokens: int
    computed_tokens: int
    evicted_tokens: int

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.computed_tokens
        return self.hit_tokens / total if total else 0.0


def working_set(trace: Sequence[tuple]) -> int:
    """Tokens in the union of everything the trace ever inserts or accesses."""
    return union_prefix_tokens((e[2] for e in trace), (e[1] for e in trace))


def replay(trace: Sequence[tuple], capacity: int, policy: str) -> ReplayResult:
    """Hit and computed tokens of the trace's accesses with `capacity` KV slots. "belady" (or
    "oracle") is the offline optimum, its future read from the trace itself."""
    oracle = policy in ("belady", "oracle")
    allocator = SlotAllocator(capacity)
    cache = RadixCache(allocator, 1, "oracle" if oracle else policy)
    marks = OracleMarks(cache) if oracle else NoMarks()
    if oracle:
        marks.load(trace)
    hits = computed = 0
    for event in trace:
        kind, namespace, ids = event[0], event[1], tuple(event[2])
        if kind == "access":
            match = cache.match_prefix(ids[: event[3]], namespace)
            hits += match.prefix_len
            computed += len(ids) - match.prefix_len
            cache.lock(match.position)  # a use: recency and hit counts (and, unlocked, the
            marks.mark_access(namespace, ids, event[3])  # path is re-ranked after this read)
            cache.unlock(match.position)
        else:
            _insert(cache, allocator, namespace, ids)
    return ReplayResult(policy, capacity, hits, computed, cache.num_evicted_tokens)


def _insert(cache: RadixCache, allocator: SlotAllocator, namespace, ids: tuple[int, ...]) -> None:
    match = cache.match_prefix(ids, namespace)
    missing = len(ids) - match.prefix_len
    if missing == 0:
        return
    cache.lock(match.position)
    if allocator.num_free_slots < missing:
        cache.evict(missing - allocator.num_free_slots)
    if allocator.num_free_slots >= missing:
        new = allocator.alloc(missing)
        cache.insert(ids, torch.cat([match.indices, new]), namespace)
    cache.unlock(match.position)
