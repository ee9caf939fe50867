"""What the "graph" eviction policy knows about each node's next use, and who writes it.

The scheduler knows the future better than recency does: which waiting request reads which
cached path (and in what order it will be admitted), and which program branch just paused at a
leaf it will extend with its next turn. `GraphMarks` writes that knowledge onto tree nodes as
`NextUse` values (eviction.py); `GraphPolicy` evicts the node whose next use is farthest, and
admission keeps the wanted ones (queued reads, branches back right away). `NoMarks` is the
same interface for every other policy, and does nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Sequence

from runtime.cache.eviction import CONTINUATION, QUEUED_READ, RETURNING, NextUse
from runtime.cache.radix import RadixCache, TreeNode, TreePosition

__all__ = ["CONTINUATION", "QUEUED_READ", "RETURNING", "GraphMarks", "NextUse", "NoMarks"]

# a branch that said it is back right away and is not back after this long (on the eviction
# clock) is forgotten: a client that went away must not keep its KV wanted
CONTINUATION_GRACE_S = 30.0


class NoMarks:
    """The marks interface for policies that do not look ahead."""

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        pass  # never asks for the positions: ordering and matching them is not free

    def mark_continuation(
        self, position: TreePosition, return_s: float, immediate: bool = False
    ) -> None:
        pass

    def mark_read(self, position: TreePosition) -> None:
        pass

    def mark_access(self, namespace: Hashable, ids: Sequence[int], match_limit: int) -> None:
        pass  # only a recorded future (oracle.py) needs every admission

    def advance(self, now_s: float) -> None:
        pass


class GraphMarks(NoMarks):
    """Keeps `node.future` current for the "graph" eviction policy.

    Two kinds of readers are known, and a node ranks by its soonest one:
    - queued reads: each waiting request's matched path, by admission order (the scheduling
      policy's order, fork groups kept together), refreshed before each eviction and before
      admission weighs what it may evict;
    - continuations: a program branch that finished a request and has more work (its next
      turn) will extend that path: right away (no declared delay: CONTINUATION, by pause
      time, so in the cyclic case the earliest paused are the soonest back and a stable
      subset stays), or when it declared (`next_turn_after_s`: RETURNING, by expected return).
      A continuation mark lasts until a request reads the path again: a conversation whose
      last turn was admitted has no future left and goes first. One that is back right away
      but is not back within CONTINUATION_GRACE_S is forgotten.
    `future_base` is what a node falls back to when queued-read marks are refreshed.
    Pinned prefixes (fork and run_batch shared prefixes) are locked and never candidates.
    """

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self._queued: list[TreeNode] = []  # nodes carrying last pass's queued-read marks
        self._immediate: list[tuple[float, int, TreeNode, NextUse]] = []  # heap: oldest first
        self._seq = itertools.count()

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        """Mark each waiting request's matched path, `positions()` in admission order: a node
        gets the rank of the earliest reader, so a path is not evicted bottom-up into "no
        reader" the moment its leaf goes. Walks the waiting paths (each shared node once),
        never the whole tree, and re-ranks only the nodes whose mark changed."""
        marks: dict[int, tuple[TreeNode, NextUse]] = {}
        for rank, position in enumerate(positions()):
            mark = NextUse(QUEUED_READ, -rank)
            node = position.node
            if position.prefix_len and not node.evicted and position.prefix_len < node.depth:
                node = self.cache.split_at(position)  # the edge's tail is not read
            while node.parent is not None and not node.evicted and id(node) not in marks:
                marks[id(node)] = (node, mark)  # an earlier reader marked what is above
                node = node.parent
        for node in self._queued:  # last pass's readers that are gone: back to the base
            if id(node) not in marks:
                self.cache.set_future(node, node.future_base)
        for node, mark in marks.values():
            self.cache.set_future(node, mark)
        self._queued = [node for node, _ in marks.values()]

    def mark_continuation(
        self, position: TreePosition, return_s: float, immediate: bool = False
    ) -> None:
        """A branch paused at `position`; it will extend the path at about `return_s` (on the
        scheduler's clock), `immediate`ly if it declared no delay. A shared node keeps the
        soonest continuation through it."""
        mark = NextUse(CONTINUATION if immediate else RETURNING, -return_s)
        node = self.cache.resolve(position)
        if immediate:
            heapq.heappush(self._immediate, (return_s, next(self._seq), node, mark))
        while node.parent is not None:
            base = node.future_base
            if base is None or base < mark:
                node.future_base = mark
                if node.future is None or node.future.kind != QUEUED_READ:
                    self.cache.set_future(node, mark)
            node = node.parent

    def mark_read(self, position: TreePosition) -> None:
        """A request locked this path: its continuation marks are used up (a next pause marks
        it again)."""
        node = self.cache.resolve(position)
        while node.parent is not None:
            if node.future_base is not None:
                self._forget(node)
            node = node.parent

    def advance(self, now_s: float) -> None:
        """Once a step: forget continuations that said "right away" and are overdue."""
        heap = self._immediate
        while heap and heap[0][0] < now_s - CONTINUATION_GRACE_S:
            _, _, node, mark = heapq.heappop(heap)
            while node.parent is not None and not node.evicted and node.future_base == mark:
                self._forget(node)
                node = node.parent

    def _forget(self, node: TreeNode) -> None:
        node.future_base = None
        if node.future is not None and node.future.kind != QUEUED_READ:
            self.cache.set_future(node, None)
