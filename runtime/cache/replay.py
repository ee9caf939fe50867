"""Replay a recorded cache access trace through a RadixCache of a given capacity, under any
eviction policy or the offline optimum for leaf-first eviction (Belady: evict the candidate
leaf whose next use is farthest, known from the rest of the trace).

Trace events (EngineConfig.record_trace): ("access", namespace, ids, match_limit) when a
request is admitted, ("insert", namespace, ids) when computed tokens enter the tree. The
replay is sequential (no concurrency, no locks beyond the access itself), so absolute hit
rates differ a little from the engine's; policies compare fairly on the same trace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.eviction import EvictionPolicy, make_eviction_policy
from runtime.cache.radix import RadixCache, TreeNode
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


class _NextUse:
    """When each tree node is next read: the first later access that enters its edge."""

    def __init__(self, trace: Sequence[tuple]) -> None:
        self.accesses = [
            (i, e[1], tuple(e[2][: e[3]])) for i, e in enumerate(trace) if e[0] == "access"
        ]
        self.now = 0
        self._memo: dict[int, tuple[int, int, float]] = {}
        self.cache: RadixCache | None = None

    def __call__(self, node: TreeNode) -> float:
        start = node.depth - len(node.key)
        memo = self._memo.get(id(node))
        if memo and memo[0] == start and memo[2] > self.now:
            return memo[2]
        path = _path(node)
        namespace = self.cache.namespace_of(node)
        found = math.inf
        for index, ns, ids in self.accesses:
            if index <= self.now or ns != namespace:
                continue
            if len(ids) > start and ids[: start + 1] == path[: start + 1]:
                found = index
                break
        self._memo[id(node)] = (start, node.version, found)
        return found


class BeladyPolicy(EvictionPolicy):
    """The offline optimum for leaf-first eviction: the farthest next use goes first."""

    name = "belady"

    def __init__(self, next_use: _NextUse) -> None:
        self.next_use = next_use

    def priority(self, node: TreeNode) -> Any:
        return (-self.next_use(node), node.last_access_time)


def replay(trace: Sequence[tuple], capacity: int, policy: str) -> ReplayResult:
    """Hit and computed tokens of the trace's accesses with `capacity` KV slots."""
    oracle = _NextUse(trace) if policy == "belady" else None
    allocator = SlotAllocator(capacity)
    cache = RadixCache(
        allocator, 1, BeladyPolicy(oracle) if oracle else make_eviction_policy(policy)
    )
    if oracle is not None:
        oracle.cache = cache
    hits = computed = 0
    for now, event in enumerate(trace):
        if oracle is not None:
            oracle.now = now
        kind, namespace, ids = event[0], event[1], tuple(event[2])
        if kind == "access":
            match = cache.match_prefix(ids[: event[3]], namespace)
            hits += match.prefix_len
            computed += len(ids) - match.prefix_len
            cache.lock(match.position)  # a use: recency, hit counts, and keeps it while
            _refresh_path(cache, match.position.node)  # ... the next-use keys move on
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


def _refresh_path(cache: RadixCache, node: TreeNode) -> None:
    while node is not None and node.parent is not None:
        cache.reprioritize(node)
        node = node.parent


def _path(node: TreeNode) -> tuple[int, ...]:
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)
