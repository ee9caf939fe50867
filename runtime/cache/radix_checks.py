"""The radix tree's invariants, recounted from its nodes (`RadixCache.check_integrity`), and
what insert checks of the slots it is given. Nothing here is on a hot path but the latter."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.cache.allocator import SlotAllocator
    from runtime.cache.nodes import RootNode, TreeNode


@dataclass
class Tally:
    """What the tree keeps running totals of, counted again edge by edge."""

    evictable: int = 0
    protected: int = 0
    wanted: int = 0  # evictable tokens of nodes the policy wants
    num_nodes: int = 0
    candidates: set[int] = field(default_factory=set)  # ids of unlocked leaves
    slots: list[torch.Tensor] = field(default_factory=list)


def tally_tree(
    roots: Iterable[RootNode], wanted: Callable[[TreeNode], bool], page_size: int
) -> Tally:
    """Walk every edge, checking it against its parent, and count the tree's totals."""
    tally = Tally()
    stack: list[TreeNode] = list(roots)
    while stack:
        node = stack.pop()
        child_locks = 0
        for key, child in node.children.items():
            check_edge(node, key, child, page_size)
            child_locks += child.lock_ref
            if not child.children and child.lock_ref == 0:
                tally.candidates.add(id(child))
            if child.lock_ref:
                tally.protected += len(child.key)
            else:
                tally.evictable += len(child.key)
                tally.wanted += len(child.key) if wanted(child) else 0
            tally.num_nodes += 1
            tally.slots.append(child.value)
            stack.append(child)
        if node.parent is not None:  # the root's lock is fixed; walks stop below it
            assert node.lock_ref >= child_locks, f"lock_ref below children's: {node!r}"
    return tally


def check_edge(parent: TreeNode, key: Hashable, child: TreeNode, page_size: int) -> None:
    """`child`, listed under `key` among `parent`'s children, is a well-formed edge below it."""
    assert not child.evicted, f"evicted node still linked: {child!r}"
    assert child.parent is parent, f"broken parent link at {child!r}"
    first = child.key[0] if page_size == 1 else child.key[:page_size]
    assert key == first, f"child keyed wrongly: {child!r}"
    assert len(child.key) > 0 and len(child.key) % page_size == 0, f"ragged {child!r}"
    assert child.value.numel() == len(child.key), f"key/value sizes: {child!r}"
    assert child.depth == parent.depth + len(child.key), f"bad depth: {child!r}"
    assert child.lock_ref >= 0, f"negative lock_ref: {child!r}"
    is_candidate = not child.children and child.lock_ref == 0
    assert (child.candidate_seq is not None) == is_candidate, f"candidate set wrong at {child!r}"


def check_roots(roots: Mapping[Hashable, RootNode], owners: Counter, roots_of: Counter) -> None:
    """Each root is locked, live and names its namespace; but the default one, each holds
    tokens (an emptied namespace's root is dropped: names cost memory, only KV pays for them);
    the live namespaces per owner (`owners`, counted again) are counted right."""
    for namespace, root in roots.items():
        assert root.lock_ref == 1 and root.depth == 0 and not root.key, "bad root"
        assert root.namespace == namespace and not root.evicted, f"root of {namespace!r}"
        assert namespace is None or root.children, f"empty root kept: {namespace!r}"
    assert owners == roots_of, f"namespaces per owner drifted: {roots_of}"


def check_slots(
    slots: torch.Tensor, in_tree: torch.Tensor, allocator: SlotAllocator, page_size: int
) -> None:
    """Every slot the tree's nodes hold is held once, allocated, marked in the tree's mask
    (`in_tree`, and nothing else is), and in whole pages in order."""
    assert torch.unique(slots).numel() == slots.numel(), "a slot is owned by two nodes"
    assert int(in_tree.sum()) == slots.numel(), "slot ownership mask drifted"
    assert bool(in_tree[slots].all()), "slot ownership mask drifted"
    assert allocator.all_allocated(slots), "the tree holds a free slot"
    if page_size > 1 and slots.numel():
        rows = slots.view(-1, page_size)
        assert bool((rows[:, 0] % page_size == 0).all()), "a node holds a partial page"
        assert bool((rows - rows[:, :1] == torch.arange(page_size)).all()), "a page out of order"


def check_new_slots(
    indices: torch.Tensor, in_tree: torch.Tensor, allocator: SlotAllocator, page_size: int
) -> None:
    """What insert is given to own: allocated slots the tree does not hold yet, in whole
    pages in order (raises ValueError: the caller's mistake, the tree is unchanged)."""
    if not allocator.all_allocated(indices):
        raise ValueError("insert got slot indices that are free or outside the pool")
    if bool(in_tree[indices].any()):
        raise ValueError("insert got slot indices the tree already holds")
    if page_size > 1:
        rows = indices.view(-1, page_size)  # (num_pages, page_size)
        first = rows[:, :1]
        steps = torch.arange(page_size, dtype=torch.int64)
        if not bool(((first % page_size == 0) & (rows - first == steps)).all()):
            raise ValueError(f"insert needs whole pages of {page_size} slots in order")
