"""What the "graph" eviction policy knows about each node's next use, and who writes it.

The scheduler knows the future better than recency does: which waiting request reads which
cached path (and in what order it will be admitted), and which program branch just paused at a
leaf it will extend with its next turn. `GraphMarks` writes that knowledge onto tree nodes as
`NextUse` values; `GraphPolicy` (eviction.py) evicts the node whose next use is farthest.
`NoMarks` is the same interface for every other policy, and does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

from runtime.cache.radix import RadixCache, TreeNode, TreePosition


class NextUse(NamedTuple):
    """A node's known next use; compared as a tuple, a larger one is kept longer.

    Nodes with no known next use (`None`) rank below every NextUse, least recently used first.
    """

    kind: int  # CONTINUATION or QUEUED_READ
    order: float  # within a kind, larger is sooner: -expected return s, or -queue rank


CONTINUATION = 1  # a paused program branch will extend this path (after everything queued)
QUEUED_READ = 2  # a waiting request reads this path


class NoMarks:
    """The marks interface for policies that do not look ahead."""

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        pass  # never asks for the positions: ordering and matching them is not free

    def mark_continuation(self, position: TreePosition, return_s: float) -> None:
        pass

    def mark_read(self, position: TreePosition) -> None:
        pass

    def mark_access(self, namespace: Hashable, ids: Sequence[int], match_limit: int) -> None:
        pass  # only a recorded future (oracle.py) needs every admission


class GraphMarks(NoMarks):
    """Keeps `node.future` current for the "graph" eviction policy.

    Two kinds of readers are known, and a node ranks by its soonest one:
    - queued reads: each waiting request's matched path, by admission order (the scheduling
      policy's order, fork groups kept together), refreshed before each eviction;
    - continuations: a program branch that finished a request and has more work (its next
      turn) will extend that path, expected back when it paused plus the delay its hints
      declare (`next_turn_after_s`; none: right away). Without declared delays the earliest
      paused is the soonest back, so in the cyclic case (more conversations than fit) the
      latest paused go first and a stable subset stays. A continuation mark lasts until a
      request reads the path again: a conversation whose last turn was admitted has no future
      left and goes first.
    `future_base` is what a node falls back to when queued-read marks are refreshed.
    Pinned prefixes (fork and run_batch shared prefixes) are locked and never candidates.
    """

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self._queued: list[TreeNode] = []  # nodes carrying last pass's queued-read marks

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
                self._set(node, node.future_base)
        for node, mark in marks.values():
            self._set(node, mark)
        self._queued = [node for node, _ in marks.values()]

    def _set(self, node: TreeNode, future: NextUse | None) -> None:
        if node.future != future:
            node.future = future
            self.cache.reprioritize(node)

    def mark_continuation(self, position: TreePosition, return_s: float) -> None:
        """A branch paused at `position`; it will extend the path at about `return_s` (on the
        scheduler's clock). A shared node keeps the soonest continuation through it."""
        mark = NextUse(CONTINUATION, -return_s)
        node = self.cache.resolve(position)
        while node.parent is not None:
            base = node.future_base
            if base is None or (base.kind == CONTINUATION and base < mark):
                node.future_base = mark
                if node.future is None or node.future.kind == CONTINUATION:
                    node.future = mark
                    self.cache.reprioritize(node)
            node = node.parent

    def mark_read(self, position: TreePosition) -> None:
        """A request locked this path: its continuation marks are used up (a next pause marks
        it again)."""
        node = self.cache.resolve(position)
        while node.parent is not None:
            if node.future_base is not None:
                node.future_base = None
                if node.future is not None and node.future.kind == CONTINUATION:
                    node.future = None
            node = node.parent
