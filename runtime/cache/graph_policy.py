"""The "graph" eviction policy: evict by each node's known next use, and who knows it.

The scheduler knows the future better than recency does: which waiting request reads which
cached path (and in what order it will be admitted), and which program branch just paused at a
leaf it will extend with its next turn. `GraphMarks` writes that knowledge onto tree nodes as
`NextUse` values (kept in the node's policy state, `GraphState`); `GraphPolicy` evicts the
node whose next use is farthest, and admission keeps the wanted ones (queued reads, branches
back right away). Only this module reads or writes a node's next use.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from runtime.cache.policy_base import EvictionPolicy, NodeState, NoMarks

if TYPE_CHECKING:
    from runtime.cache.radix import RadixCache, TreeNode, TreePosition


class NextUse(NamedTuple):
    """A node's known next use; compared as a tuple, a larger one is kept longer. Nodes with no
    known next use (`None`) rank below every NextUse, least recently used first."""

    kind: int  # RETURNING, CONTINUATION or QUEUED_READ
    order: float  # within a kind, larger is sooner: -expected return s, or -queue rank


RETURNING = 1  # a paused program branch declared when it will be back to extend this path
CONTINUATION = 2  # a paused program branch will extend this path right away
QUEUED_READ = 3  # a waiting request reads this path

# a branch that said it is back right away and is not back after this long (on the eviction
# clock) is forgotten: a client that went away must not keep its KV wanted
CONTINUATION_GRACE_S = 30.0


class GraphState(NodeState):
    """A node's next use (`future`), and what it falls back to when queued-read marks are
    refreshed (`base`: its continuation mark, if any)."""

    __slots__ = ("future", "base")

    def __init__(self) -> None:
        super().__init__()
        self.future: tuple | None = None
        self.base: tuple | None = None

    def head(self) -> GraphState:
        state = super().head()
        state.future = state.base = self.base  # a reader of the edge reads its head
        return state


class GraphPolicy(EvictionPolicy):
    """Evict by estimated next use, known from the program graph; recency breaks ties.

    A node's next use is written by `GraphMarks` (`set_future`):
    - None: no known reader: evicted first, least recently used first;
    - NextUse(RETURNING, -t): a program branch that paused here declared it is back at time t
      to extend it;
    - NextUse(CONTINUATION, -t): a branch that paused here at t is back right away (its next
      request is not queued yet, so it is needed after everything already waiting);
    - NextUse(QUEUED_READ, -rank): a waiting request at queue position `rank` reads it.
    Belady's rule, with the next use taken from the queue and the programs instead of guessed.
    Continuations and queued reads are wanted: admission does not evict them for a request
    that reads less while anything else runs (scheduler.py). Pinned prefixes (fork and
    run_batch shared prefixes) are locked and never candidates.
    """

    name = "graph"
    state_type = GraphState

    def priority(self, node: TreeNode) -> Any:
        future = self.future(node)
        return (0, node.last_access_time) if future is None else future

    def wanted(self, node: TreeNode) -> bool:
        future = self.future(node)
        return future is not None and future[0] >= CONTINUATION

    def future(self, node: TreeNode) -> tuple | None:
        """What is known of `node`'s next use (None: nothing)."""
        state = node.policy_state
        return state.future if state is not None else None

    def base(self, node: TreeNode) -> tuple | None:
        """`node`'s continuation mark, what it falls back to when not a queued read."""
        state = node.policy_state
        return state.base if state is not None else None

    def set_future(self, node: TreeNode, future: tuple | None) -> bool:
        """Set `node`'s next use, keeping `wanted_size` in step; returns whether it changed
        (then the tree must re-rank the node: `RadixCache.reprioritize`)."""
        if self.future(node) == future:
            return False
        unlocked = node.lock_ref == 0 and not node.evicted
        if unlocked and self.wanted(node):
            self.wanted_size -= len(node.key)
        self.state(node).future = future
        if unlocked and self.wanted(node):
            self.wanted_size += len(node.key)
        return True

    def set_base(self, node: TreeNode, base: tuple | None) -> None:
        self.state(node).base = base


class GraphMarks(NoMarks):
    """Keeps each node's next use current for the "graph" eviction policy.

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
    A node's `base` is what it falls back to when queued-read marks are refreshed.
    Pinned prefixes (fork and run_batch shared prefixes) are locked and never candidates.
    """

    keeps_wanted = True

    def __init__(self, cache: RadixCache) -> None:
        if not isinstance(cache.policy, GraphPolicy):
            raise ValueError("GraphMarks needs a RadixCache with the 'graph' eviction policy")
        self.cache = cache
        self.policy: GraphPolicy = cache.policy
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
                self._set_future(node, self.policy.base(node))
        for node, mark in marks.values():
            self._set_future(node, mark)
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
        policy = self.policy
        while node.parent is not None:
            base = policy.base(node)
            if base is None or base < mark:
                policy.set_base(node, mark)
                future = policy.future(node)
                if future is None or future.kind != QUEUED_READ:
                    self._set_future(node, mark)
            node = node.parent

    def mark_read(self, position: TreePosition) -> None:
        """A request locked this path: its continuation marks are used up (a next pause marks
        it again)."""
        node = self.cache.resolve(position)
        while node.parent is not None:
            if self.policy.base(node) is not None:
                self._forget(node)
            node = node.parent

    def forget_private(self, path: Iterable[TreeNode]) -> None:
        """A paused branch is not waited for any more (its program was displaced, programs.py):
        `path` is the part of its path only it reads (nodes.private_path), whose marks are
        dropped so that it goes first when the pool needs room; shared parts keep their
        readers' marks."""
        for node in path:
            if self.policy.base(node) is not None:
                self._forget(node)

    def advance(self, now_s: float) -> None:
        """Once a step: forget continuations that said "right away" and are overdue."""
        heap = self._immediate
        while heap and heap[0][0] < now_s - CONTINUATION_GRACE_S:
            _, _, node, mark = heapq.heappop(heap)
            while node.parent is not None and not node.evicted and self.policy.base(node) == mark:
                self._forget(node)
                node = node.parent

    def _forget(self, node: TreeNode) -> None:
        self.policy.set_base(node, None)
        future = self.policy.future(node)
        if future is not None and future.kind != QUEUED_READ:
            self._set_future(node, None)

    def _set_future(self, node: TreeNode, future: tuple | None) -> None:
        if self.policy.set_future(node, future):
            self.cache.reprioritize(node)
