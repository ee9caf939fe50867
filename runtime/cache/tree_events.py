"""What a radix tree tells the listeners it was built with (RadixCache(..., listeners=...)).

The tree keeps its nodes, locks and eviction order; everything that follows its changes from
the side (KV events for routers, demotion to the lower tiers, speculation's token index) is a
`TreeListener`, registered once when the tree is built, never assigned onto it later. Each
listener overrides only what it needs; the rest are no-ops.

Events, in the order the tree makes them:
- `edge_stored(EdgeStored)`: insert added a new edge (its slots now the tree's);
- `leaf_evicted(LeafEvicted)`: evict is taking a leaf edge; told before the edge is unlinked
  and its slots freed (they still hold its KV). Its path and slots are read off the tree only
  when a listener asks for them;
- `slots_freed(slots)`: evicted slots went back to the allocator;
- `cleared()`: reset dropped everything.
Splits change no cached token and tell nobody.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.cache.radix import RadixCache, TreeNode


class EdgeStored:
    """`key[start:]` became cached as a new edge whose slots are `slots`, under the cached
    path `key[:start]` (whose last slot is `prev_slot`, -1 at a root)."""

    __slots__ = ("namespace", "key", "start", "slots", "_above")

    def __init__(
        self,
        namespace: Hashable,
        key: tuple[int, ...],
        start: int,
        slots: torch.Tensor,
        above: torch.Tensor,
    ) -> None:
        self.namespace = namespace
        self.key = key  # the whole inserted key, from the root
        self.start = start
        self.slots = slots  # (len(key) - start,) int64
        self._above = above  # slots of the edge this one hangs under (none under a root)

    @property
    def prev_slot(self) -> int:
        return int(self._above[-1]) if self._above.numel() else -1


class LeafEvicted:
    """A leaf edge `evict` is taking, while its slots (and its ancestors') still hold its KV.
    The walk up to the root is made once, and only if a listener reads the path or slots."""

    def __init__(self, leaf: TreeNode) -> None:
        self.leaf = leaf

    @property
    def start(self) -> int:
        """Where the evicted edge starts: `path[:start]` stays cached."""
        return self.leaf.depth - len(self.leaf.key)

    @cached_property
    def _walk(self) -> tuple[Hashable, list[TreeNode]]:
        nodes, node = [], self.leaf
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        return node.namespace, nodes[::-1]

    @property
    def namespace(self) -> Hashable:
        return self._walk[0]

    @cached_property
    def path(self) -> tuple[int, ...]:
        """The tokens from the root to the end of the evicted edge."""
        return tuple(t for node in self._walk[1] for t in node.key)

    @cached_property
    def path_slots(self) -> torch.Tensor:
        """The slots of `path` (the evicted edge's last)."""
        return torch.cat([node.value for node in self._walk[1]])


class TreeListener:
    """Told of a radix tree's changes (see the module docstring); every method is a no-op."""

    def edge_stored(self, event: EdgeStored) -> None:
        pass

    def leaf_evicted(self, event: LeafEvicted) -> None:
        pass

    def slots_freed(self, slots: torch.Tensor) -> None:
        pass

    def cleared(self) -> None:
        pass

    def check_integrity(self, cache: RadixCache) -> None:
        """Called by the tree's `check_integrity`: assert this listener agrees with it."""


def edge_paths(cache: RadixCache) -> Iterator[tuple[Hashable, tuple[int, ...], int]]:
    """(namespace, path from the root, depth where the edge starts) per edge, parents first:
    the tree as `stored` KV events (a subscriber's snapshot; `RadixCache.edge_paths`)."""
    for namespace, root in cache.roots().items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + node.key
            yield namespace, path, len(above)
            stack.extend((child, path) for child in node.children.values())
