"""The radix tree's types: its nodes, a point in it, what a match and an insert return, and
whose a namespace is. Apart from the tree (radix.py), so that the cache protocol (base.py) and
its readers need nothing of the tree's implementation."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from runtime.prefix import common_prefix_len

Namespace = Hashable  # cache salt / adapter id; None is the default namespace
EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge: `key` tokens and their `value` slot indices, ending `depth` tokens deep."""

    __slots__ = (
        "key",
        "value",
        "children",
        "parent",
        "depth",
        "lock_ref",
        "last_access_time",
        "creation_time",
        "hit_count",
        "priority",
        "candidate_seq",
        "evicted",
        "version",
        "policy_state",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        parent: TreeNode | None,
        depth: int,
        now: int,
        priority: int = 0,
    ) -> None:
        self.key = key
        self.value = value  # (len(key),) int64 slot indices
        self.children: dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.depth = depth  # tokens from the root to the end of this edge
        self.lock_ref = 0
        self.last_access_time = now
        self.creation_time = now
        self.hit_count = 1
        self.priority = priority
        self.candidate_seq: int | None = None  # set while in the eviction candidate queue
        self.evicted = False
        self.version = 0  # bumped when a match ending here could now go further (see _bump)
        self.policy_state = None  # the eviction policy's, opaque to the tree (policy_base.py)

    def __repr__(self) -> str:
        head = ",".join(map(str, self.key[:6])) + ("..." if len(self.key) > 6 else "")
        return f"TreeNode(len={len(self.key)}, key=[{head}], depth={self.depth}, r={self.lock_ref})"


class RootNode(TreeNode):
    """A namespace's root: no tokens, permanently locked, and it knows its namespace (so a
    path's namespace is read off its root, never searched for among all the roots)."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: Namespace, now: int) -> None:
        super().__init__((), EMPTY_SLOTS, None, 0, now)
        self.namespace = namespace
        self.lock_ref = 1  # permanently locked: lock/unlock walks stop here


@dataclass(frozen=True, slots=True)
class TreePosition:
    """A point in the tree: the first `prefix_len` tokens down the path through `node`.

    The point may lie inside `node`'s edge. Positions survive later splits (they are re-resolved
    on use); they go stale only when their tokens are evicted.
    """

    node: TreeNode
    prefix_len: int


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Where a key's cached prefix ends, and the slots holding it."""

    indices: torch.Tensor  # (prefix_len,) int64 slot indices of the matched prefix
    position: TreePosition
    prefix_len: int


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What `insert` did: `prefix_len` tokens were cached before (the caller's own slots for
    them are duplicates); the tree now holds the key up to `position` in `indices`."""

    prefix_len: int
    position: TreePosition
    indices: torch.Tensor  # (position.prefix_len,) int64: the tree's slots for the aligned key


def owner_of(namespace: Namespace) -> Hashable:
    """Whose a namespace is: its first '/'-separated part (the server puts the API key's tag
    there), the namespace itself if it is no string. Namespaces, hints and remembered program
    branches are bounded per owner."""
    return namespace.split("/", 1)[0] if isinstance(namespace, str) else namespace


def current_edge(node: TreeNode, prefix_len: int) -> TreeNode:
    """The node whose edge holds a position's end now: `node` or an ancestor (its edge split
    since the position was taken)."""
    while node.parent is not None and node.parent.depth >= prefix_len:
        node = node.parent
    return node


def unlocked_on_path(node: TreeNode, prefix_len: int) -> int:
    """Tokens on the path to a position (`node`, `prefix_len`) that no lock holds."""
    node = current_edge(node, prefix_len)
    if node.parent is None or node.evicted or node.lock_ref:
        return 0  # (a lock holds its whole path to the root)
    unlocked = prefix_len - (node.depth - len(node.key))  # its edge, up to the position
    node = node.parent
    while node.parent is not None and not node.lock_ref:
        unlocked += len(node.key)
        node = node.parent
    return unlocked


def private_path(node: TreeNode) -> Iterator[TreeNode]:
    """`node` and its ancestors up to where another path branches off (that node and the
    ones above it are shared): the part of a path only its own reader holds."""
    while node.parent is not None and not node.evicted:
        yield node
        parent = node.parent
        if parent.parent is None or len(parent.children) > 1:
            return
        node = parent


def path_shares(node: TreeNode, token_ids: tuple[int, ...]) -> int:
    """How many leading tokens of `token_ids` the path from the root to the end of `node`'s
    edge holds (its key and parents outlive an eviction): one compare per edge, not per token.
    """
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    shared = 0
    for key in reversed(keys):
        same = common_prefix_len(key, token_ids, shared)
        shared += same
        if same < len(key):
            break
    return shared
