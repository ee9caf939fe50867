"""What the "graph" eviction policy knows about each node's next use, and who writes it.

The scheduler knows the future better than recency does: which waiting request reads which
cached path (and in what order it will be admitted), and which program branch just paused at a
leaf it will extend with its next turn. `GraphMarks` writes that knowledge onto tree nodes as
`NextUse` values; `GraphPolicy` (eviction.py) evicts the node whose next use is farthest.
`NoMarks` is the same interface for every other policy, and does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from runtime.cache.radix import RadixCache, TreeNode, TreePosition


class NextUse(NamedTuple):
    """A node's known next use; compared as a tuple, a larger one is kept longer.

    Nodes with no known next use (`None`) rank below every NextUse, least recently used first.
    """

    kind: int  # CONTINUATION or QUEUED_READ
    order: int  # within a kind, larger is sooner: -step for continuations, -rank for reads


CONTINUATION = 1  # a paused program branch will extend this path (after everything queued)
QUEUED_READ = 2  # a waiting request reads this path


class GraphMarks:
    """Keeps `node.future` current for the "graph" eviction policy.

    `future_base` is what a node falls back to when queued-read marks are refreshed: its
    continuation mark, if a branch paused there and no request has read it since.
    """

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self._queued: list[TreeNode] = []  # nodes carrying last pass's queued-read marks

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        """Mark each waiting request's matched path, `positions()` in admission order: a node
        gets the rank of the earliest reader, so a path is not evicted bottom-up into "no
        reader" the moment its leaf goes."""
        for node in self._queued:  # the last pass's marks are stale now
            node.future = node.future_base
            self.cache.reprioritize(node)
        self._queued = []
        for rank, position in enumerate(positions()):
            mark = NextUse(QUEUED_READ, -rank)
            node = position.node
            while node.parent is not None and not node.evicted:
                if node.future is not None and node.future >= mark:
                    break  # an earlier reader marked this node and its ancestors already
                node.future = mark
                self._queued.append(node)
                self.cache.reprioritize(node)
                node = node.parent

    def mark_continuation(self, position: TreePosition, step: int) -> None:
        """A branch paused at `position` and its program will extend it soon."""
        mark = NextUse(CONTINUATION, -step)
        node = self.cache.resolve(position)
        while node.parent is not None and (node.future is None or node.future.kind == CONTINUATION):
            node.future_base = node.future = mark
            node = node.parent

    def mark_read(self, position: TreePosition) -> None:
        """A request locked this path: it is no longer a pending continuation."""
        self.cache.resolve(position).future_base = None


class NoMarks:
    """The marks interface for policies that do not look ahead."""

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        pass  # never asks for the positions: ordering and matching them is not free

    def mark_continuation(self, position: TreePosition, step: int) -> None:
        pass

    def mark_read(self, position: TreePosition) -> None:
        pass
