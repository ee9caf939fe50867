"""What an eviction policy is to the radix tree, and to the KV manager.

To the tree (radix.py), a policy orders eviction candidates (`priority`), says which nodes a
known reader wants soon (`wanted`), and keeps whatever it knows per node in the node's one
opaque slot, `TreeNode.policy_state`: the tree never reads it, and tells the policy what it
needs to keep that state and its `wanted_size` right (the hooks below: a node's tokens stop or
start being evictable, an edge is split, a leaf is evicted, the tree is cleared).

To the KV manager (scheduler/kv.py), a policy that looks ahead comes with marks: what the
manager knows of the future (the queue, paused programs, a recording) reaches the policy
through them. `NoMarks` is that interface for policies that do not look ahead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.cache.nodes import TreeNode, TreePosition


class NodeState:
    """What a policy keeps on one node (`TreeNode.policy_state`), made on first use."""

    __slots__ = ("reads",)

    def __init__(self) -> None:
        self.reads = 0  # admissions whose cache hit ended exactly here (note_read)

    def head(self) -> NodeState:
        """The state of an edge's head when a split cuts it off: a reader of the whole edge
        read the head too."""
        state = type(self)()
        state.reads = self.reads
        return state


class EvictionPolicy(ABC):
    """Orders eviction candidates: the leaf with the smallest `priority(node)` goes first.

    A policy reads node fields (last_access_time, creation_time, hit_count, priority) and its
    own `policy_state`. When a key changes while the node is a candidate, the tree must be told
    (`RadixCache.reprioritize(node)`), so the queue can re-order it.
    """

    name: str
    state_type: type[NodeState] = NodeState
    # evictable tokens of wanted nodes; only a policy that wants any keeps it (the hooks)
    wanted_size: int = 0

    @abstractmethod
    def priority(self, node: TreeNode) -> Any:
        """Sort key; smaller is evicted first. Ties go to the node that became a candidate first."""

    def wanted(self, node: TreeNode) -> bool:
        """Whether a known reader needs `node` soon: admission keeps such KV rather than evict
        it for a request that reads less (`wanted_size`). Wanted nodes must rank after every
        unwanted one. Only a policy that knows the future wants anything."""
        return False

    def future(self, node: TreeNode) -> tuple | None:
        """What the policy knows of `node`'s next use (a graph_policy.NextUse), if anything."""
        return None

    # ------------------------------------------------------------ the tree's hooks
    # Each keeps `wanted_size` in step (one `wanted` call: what the tree paid before the
    # policy kept it), so a policy that wants nodes needs only to say which.
    def protected(self, node: TreeNode) -> None:
        """`node` (unlocked so far) is being locked: its tokens stop being evictable."""
        self._count(node, -1)

    def unprotected(self, node: TreeNode) -> None:
        """`node`'s last lock went: its tokens are evictable again."""
        self._count(node, +1)

    def removed(self, node: TreeNode) -> None:
        """`node`, an unlocked leaf, was evicted (unlinked; its tokens are gone)."""
        self._count(node, -1)

    def split(self, lower: TreeNode, upper: TreeNode) -> None:
        """`upper` is cut off the head of `lower`'s edge (with `lower`'s lock_ref; `lower`'s
        key is still whole): the head's state and wanted tokens move to `upper`."""
        unlocked, head = upper.lock_ref == 0, len(upper.key)
        if unlocked and self.wanted(lower):
            self.wanted_size -= head
        state = lower.policy_state
        if state is not None:
            upper.policy_state = state.head()
        if unlocked and self.wanted(upper):
            self.wanted_size += head

    def cleared(self) -> None:
        """The tree dropped every node."""
        self.wanted_size = 0

    # ------------------------------------------------------------ per-node state
    def state(self, node: TreeNode) -> NodeState:
        """`node`'s state, made now if it has none."""
        state = node.policy_state
        if state is None:
            state = node.policy_state = self.state_type()
        return state

    def note_read(self, node: TreeNode) -> int:
        """An admission's cache hit ended exactly at (locked) `node`: count it; returns how
        many admissions read this exact prefix so far (a hotness signal; locks count re-locks
        by the same request too)."""
        state = self.state(node)
        state.reads += 1
        return state.reads

    def _count(self, node: TreeNode, sign: int) -> None:
        """Add (+1) or take away (-1) `node`'s tokens from `wanted_size`, if it is wanted."""
        if self.wanted(node):
            self.wanted_size += sign * len(node.key)


class NoMarks:
    """The marks interface for policies that do not look ahead."""

    # whether admission should keep KV a known reader needs soon (the policy wants some)
    keeps_wanted = False

    def mark_queued_reads(self, positions: Callable[[], Iterable[TreePosition]]) -> None:
        pass  # never asks for the positions: ordering and matching them is not free

    def mark_continuation(
        self, position: TreePosition, return_s: float, immediate: bool = False
    ) -> None:
        pass

    def mark_read(self, position: TreePosition) -> None:
        pass

    def forget_private(self, path: Iterable[TreeNode]) -> None:
        pass

    def mark_access(self, namespace: Hashable, ids: Sequence[int], match_limit: int) -> None:
        pass  # only a recorded future (oracle.py) needs every admission

    def advance(self, now_s: float) -> None:
        pass
