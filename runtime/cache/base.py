"""The prefix cache interface the scheduler programs against, and its null object.

`RadixCache` (radix.py) is the real one. `NullCache` is what `disable_radix_cache` gives: it
matches nothing and takes nothing, so every request computes and frees its own KV, through the
very same code path (no "is there a cache?" branches anywhere). A pin could only be kept by a
cache, so `Engine.pin` answers it without the scheduler (computes nothing, holds nothing): a
prefilled pin's KV would be freed at once and every reader would compute it again.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Any, Protocol, TextIO

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.nodes import InsertResult, MatchResult, TreeNode, TreePosition

Namespace = Hashable


class PrefixCache(Protocol):
    """A cache of KV slot indices keyed by token ids (whole pages).

    Contract: `match_prefix` is pure; `insert` takes ownership of the caller's slots beyond
    what was already cached (up to the returned position); a prefix stays cached while it is
    locked (`lock`/`unlock` pair by position); `evict` frees only unlocked tokens. Every
    mutation happens on the engine's loop thread.
    """

    allocator: SlotAllocator
    page_size: int
    can_share: bool  # whether inserted tokens are matched later (prefill-once waits need it)
    evictable_size: int
    protected_size: int
    wanted_size: int  # evictable tokens a known reader needs soon (the policy's `wanted`)
    num_nodes: int
    num_evicted_tokens: int

    @property
    def total_size(self) -> int: ...

    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = None) -> MatchResult:
        """Longest cached prefix of `token_ids`."""

    def match_is_current(self, position: TreePosition, version: int) -> bool:
        """Whether a match that ended at `position` (node version `version`) still holds."""

    def insert(
        self,
        token_ids: Sequence[int],
        indices: torch.Tensor,
        namespace: Namespace = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache the key's whole pages; see RadixCache.insert."""

    def lock(self, where: TreePosition) -> int:
        """Protect the prefix up to `where` from eviction."""

    def unlock(self, where: TreePosition) -> int:
        """Undo one lock(where)."""

    def unlocked_tokens(self, position: TreePosition) -> int:
        """Tokens up to a current `position` that no lock holds: what lock(position) moves
        out of evictable_size."""

    def slot_indices(self, position: TreePosition) -> torch.Tensor:
        """Slots of the (locked) prefix up to `position`."""

    def resolve(self, position: TreePosition) -> TreeNode:
        """The node a locked position ends at."""

    def reprioritize(self, node: TreeNode) -> None:
        """Re-order `node` among eviction candidates."""

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots if possible; return how many."""

    def roots(self) -> dict[Namespace, TreeNode]:
        """Each namespace's root node (pictures walk the tree from here)."""

    def edge_paths(self):
        """(namespace, path, start depth) per edge, parents first (a KV events snapshot)."""

    def leaves(self):
        """Every node without children: the ends of cached paths (persisted at shutdown)."""

    def eviction_order(self, limit: int) -> list[TreeNode]:
        """The first `limit` leaves eviction would take now, in order."""

    def check_integrity(self, num_caller_slots: int | None = None) -> None:
        """Assert invariants; with `num_caller_slots`, slot conservation too."""

    def pretty_print(self, file: TextIO | None = None, **view: Any) -> str:
        """The cache as text; `view`: tree_text's cuts (max_tokens, max_depth, max_children)
        and `render` for an edge's first tokens."""


class NullCache:
    """No prefix cache: nothing matches, nothing is taken, nothing is ever locked."""

    can_share = False

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.evictable_size = self.protected_size = self.wanted_size = self.num_nodes = 0
        self.num_evicted_tokens = 0
        self._root = TreeNode((), _EMPTY, None, 0, 0)
        self._nowhere = TreePosition(self._root, 0)

    @property
    def total_size(self) -> int:
        return 0

    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = None) -> MatchResult:
        return MatchResult(_EMPTY, self._nowhere, 0)

    def match_is_current(self, position: TreePosition, version: int) -> bool:
        return True  # nothing is ever cached, so "no match" never goes out of date

    def insert(
        self,
        token_ids: Sequence[int],
        indices: torch.Tensor,
        namespace: Namespace = None,
        priority: int = 0,
    ) -> InsertResult:
        return InsertResult(0, self._nowhere, _EMPTY)  # the caller keeps (and frees) its slots

    def lock(self, where: TreePosition) -> int:
        raise RuntimeError("nothing is cached, so nothing can be locked")

    unlock = lock

    def unlocked_tokens(self, position: TreePosition) -> int:
        return 0

    def slot_indices(self, position: TreePosition) -> torch.Tensor:
        return _EMPTY

    def resolve(self, position: TreePosition) -> TreeNode:
        return self._root

    def reprioritize(self, node: TreeNode) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def roots(self) -> dict[Namespace, TreeNode]:
        return {}

    def edge_paths(self):
        return iter(())

    def leaves(self):
        return iter(())

    def eviction_order(self, limit: int) -> list[TreeNode]:
        return []

    def check_integrity(self, num_caller_slots: int | None = None) -> None:
        self.allocator.check_integrity()
        if num_caller_slots is not None:
            free = self.allocator.num_free_slots
            assert free + num_caller_slots == self.allocator.num_slots, (
                f"slots lost or double-owned: free {free} + callers {num_caller_slots} "
                f"!= {self.allocator.num_slots}"
            )

    def pretty_print(self, file: TextIO | None = None, **view: Any) -> str:
        text = "(the radix cache is disabled)"
        print(text, file=file or sys.stdout)
        return text


_EMPTY = torch.empty(0, dtype=torch.int64)
