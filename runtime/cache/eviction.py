"""The eviction policies by name (the order among evictable leaves), the simple ones, and the
incremental candidate queue. What a policy is: policy_base.py; "graph": graph_policy.py."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runtime.cache.graph_policy import GraphPolicy
from runtime.cache.policy_base import EvictionPolicy

if TYPE_CHECKING:
    from runtime.cache.nodes import TreeNode


class KeyedPolicy(EvictionPolicy):
    """A policy that is one sort key over node fields (the simple ones, named in KEYED)."""

    def __init__(self, name: str, key: Callable[[TreeNode], Any]) -> None:
        self.name = name
        self._key = key

    def priority(self, node: TreeNode) -> Any:
        return self._key(node)


# name -> sort key; smaller is evicted first
KEYED: dict[str, Callable[[TreeNode], Any]] = {
    "lru": lambda node: node.last_access_time,
    "lfu": lambda node: (node.hit_count, node.last_access_time),
    "fifo": lambda node: node.creation_time,
    "mru": lambda node: -node.last_access_time,
    "filo": lambda node: -node.creation_time,
    # lower per-insert priority first, then least recently used
    "priority": lambda node: (node.priority, node.last_access_time),
}


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: nodes hit fewer than `protected_hits` times go first, LRU inside a segment."""

    name = "slru"

    def __init__(self, protected_hits: int = 2) -> None:
        self.protected_hits = protected_hits

    def priority(self, node: TreeNode) -> Any:
        return (node.hit_count >= self.protected_hits, node.last_access_time)


class OraclePolicy(EvictionPolicy):
    """Benchmarks only: the offline optimum for leaf-first eviction (Belady), the farthest next
    use first, never-again first of all. `next_use(node)` comes from a recording of the same
    work (oracle.py: `OracleMarks`, or the trace replay); without one every node is "never"
    and this is LRU."""

    name = "oracle"

    def __init__(self, next_use: Callable[[TreeNode], float] | None = None) -> None:
        self.next_use = next_use

    def priority(self, node: TreeNode) -> Any:
        next_use = self.next_use(node) if self.next_use is not None else math.inf
        return (-next_use, node.last_access_time)


# name -> a fresh instance
EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    **{name: functools.partial(KeyedPolicy, name, key) for name, key in KEYED.items()},
    **{cls.name: cls for cls in (SLRUPolicy, GraphPolicy, OraclePolicy)},
}


def make_eviction_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A policy instance from its name (or the instance itself)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return EVICTION_POLICIES[policy]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy!r}; choose one of {sorted(EVICTION_POLICIES)}"
        ) from None


class CandidateQueue:
    """The evictable leaves in policy order, kept incrementally (a heap with lazy deletion).

    add / discard / pop cost O(log L) amortized for L candidates; stale heap entries are
    skipped on pop and the heap is compacted when they outnumber live ones.
    """

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self._heap: list[tuple[Any, int, TreeNode]] = []
        self._seq = itertools.count()
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def __contains__(self, node: TreeNode) -> bool:
        return node.candidate_seq is not None

    def add(self, node: TreeNode) -> None:
        """Make `node` a candidate, or re-order it if its key changed."""
        if node.candidate_seq is None:
            self._num_live += 1
        seq = next(self._seq)
        node.candidate_seq = seq
        heapq.heappush(self._heap, (self.policy.priority(node), seq, node))
        if len(self._heap) > 2 * self._num_live + 64:
            self._compact()

    def discard(self, node: TreeNode) -> None:
        """Remove `node` from the candidates (no-op if it is not one)."""
        if node.candidate_seq is not None:
            node.candidate_seq = None
            self._num_live -= 1

    def pop(self) -> TreeNode | None:
        """Remove and return the first candidate in policy order, or None when empty."""
        heap = self._heap
        while heap:
            _, seq, node = heapq.heappop(heap)
            if node.candidate_seq == seq:
                node.candidate_seq = None
                self._num_live -= 1
                return node
        return None

    def first(self, limit: int) -> list[TreeNode]:
        """The first `limit` live candidates in the order `pop` would return them."""
        live = (entry for entry in self._heap if entry[2].candidate_seq == entry[1])
        return [node for _, _, node in heapq.nsmallest(limit, live, key=lambda e: e[:2])]

    def nodes(self) -> list[TreeNode]:
        """The live candidates (any order)."""
        return [node for _, seq, node in self._heap if node.candidate_seq == seq]

    def clear(self) -> None:
        for node in self.nodes():
            node.candidate_seq = None
        self._heap = []
        self._num_live = 0

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if entry[2].candidate_seq == entry[1]]
        heapq.heapify(self._heap)
