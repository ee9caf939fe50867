"""The offline optimum as an engine eviction policy, for benchmarks: a recorded access trace of
one run tells a second run every future read by token path (greedy outputs do not depend on the
cache, so the second run reads exactly the paths the first one recorded).

`FutureAccesses` indexes the recording's accesses in a token trie: each trie node lists, in
recorded order, the accesses that pass through it. An access read in this run is consumed (by its
exact key, whatever order this run admits it in), so a node's next use is the first recorded
access through its edge that has not happened yet. `OracleMarks` keeps the index in step with
admissions; `OraclePolicy` (eviction.py) evicts the farthest next use first (Belady).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from runtime.cache.eviction import OraclePolicy
from runtime.cache.policy_base import NoMarks

if TYPE_CHECKING:
    from runtime.cache.radix import RadixCache, TreeNode


class _TrieNode:
    __slots__ = ("children", "readers", "next_pos")

    def __init__(self) -> None:
        self.children: dict[int, _TrieNode] = {}
        self.readers: list[int] = []  # recorded access indices through this token, ascending
        self.next_pos = 0  # readers[:next_pos] are consumed (advanced lazily)


class FutureAccesses:
    """The recorded accesses, by path: when is a tree node next read?

    >>> future = FutureAccesses([("access", None, (1, 2, 3), 3), ("access", None, (1, 5), 2)])
    >>> future.next_read(None, (1, 2)), future.consume(None, (1, 2, 3))
    (0, True)
    >>> future.next_read(None, (1, 2)), future.next_read(None, (1,))
    (inf, 1)
    """

    def __init__(self, trace: Iterable[tuple]) -> None:
        self._roots: dict[Hashable, _TrieNode] = defaultdict(_TrieNode)
        self._by_key: dict[tuple, deque[int]] = defaultdict(deque)
        self._consumed: list[bool] = []
        for index, event in enumerate(trace):
            self._consumed.append(False)
            if event[0] == "access":
                self._record(index, event[1], tuple(event[2][: event[3]]))

    def _record(self, index: int, namespace: Hashable, key: tuple[int, ...]) -> None:
        self._by_key[(namespace, key)].append(index)
        trie = self._roots[namespace]
        for token in key:
            trie = trie.children.setdefault(token, _TrieNode())
            trie.readers.append(index)

    def consume(self, namespace: Hashable, key: Sequence[int]) -> bool:
        """This run read `key`: its earliest unread recorded access is in the past now."""
        pending = self._by_key.get((namespace, tuple(key)))
        if not pending:
            return False  # not in the recording (a retracted request's new key): no change
        self._consumed[pending.popleft()] = True
        return True

    def next_read(self, namespace: Hashable, path: Sequence[int]) -> float:
        """Index of the first unconsumed recorded access that reads `path`'s last token; inf if
        none will."""
        trie = self._roots.get(namespace)
        for token in path:
            trie = trie.children.get(token) if trie is not None else None
            if trie is None:
                return math.inf
        if trie is None or not path:
            return math.inf
        readers, consumed = trie.readers, self._consumed
        while trie.next_pos < len(readers) and consumed[readers[trie.next_pos]]:
            trie.next_pos += 1
        return readers[trie.next_pos] if trie.next_pos < len(readers) else math.inf


class OracleMarks(NoMarks):
    """Keeps an `OraclePolicy` cache's view of the future current: the recording is loaded
    before the run and every admission consumes its access."""

    def __init__(self, cache: RadixCache) -> None:
        if not isinstance(cache.policy, OraclePolicy):
            raise ValueError("OracleMarks needs a RadixCache with the 'oracle' eviction policy")
        self.cache = cache
        self.future = FutureAccesses(())
        cache.policy.next_use = self.next_use

    def load(self, trace: Sequence[tuple]) -> None:
        """Use `trace` (a recorded run of the same work) as the future; before any request."""
        if self.cache.total_size:
            raise ValueError("load the oracle's recording into an empty cache, before the run")
        self.future = FutureAccesses(trace)

    def mark_access(self, namespace: Hashable, ids: Sequence[int], match_limit: int) -> None:
        """An admitted request reads `ids[:match_limit]`; its locked path is re-ranked on unlock."""
        self.future.consume(namespace, ids[:match_limit])

    def next_use(self, node: TreeNode) -> float:
        """When `node`'s last token is next read: eviction takes a leaf's tail first, and
        whatever is left of the edge is ranked again by its own last token."""
        return self.future.next_read(self.cache.namespace_of(node), path_to(node, node.depth))


def path_to(node: TreeNode, length: int) -> tuple[int, ...]:
    """The first `length` tokens of the root path through `node`."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)[:length]
