"""Radix tree over token ids whose nodes hold KV slot indices (never KV bytes).

Semantics follow SGLang's RadixCache (node = maximal run shared by the same requests, lock_ref
along root paths, leaf-first eviction), with five differences:
- `match_prefix` is pure: a match ending inside an edge returns a `TreePosition` and splits
  nothing; `lock` (or `insert`) splits only when it must.
- Eviction candidates (unlocked leaves) are kept in policy order incrementally, so `evict` costs
  O(k log L) for k victims among L leaves instead of re-heapifying every leaf per call.
- `evict(n)` frees n tokens (whole pages), not whole nodes: the last victim loses only the
  tail it must, and its head stays cached.
- Recency and hit counts come from `lock`/`unlock`/`insert` (real uses) on a logical clock, so
  scoring a match for scheduling does not count as a use and orders are deterministic.
- A namespace's root exists only while it holds tokens: a read of an unknown namespace makes
  none, and eviction drops the root it empties (names are the clients'; only KV pays for them).

What the policy knows per node is the policy's (policy_base.py); KV events, demotion to the
lower tiers and speculation's token index are listeners the tree is built with (tree_events.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.eviction import CandidateQueue, make_eviction_policy
from runtime.cache.nodes import (  # (re-exported: the tree's types, imported from here too)
    EMPTY_SLOTS,
    InsertResult,
    MatchResult,
    Namespace,
    RootNode,
    TreeNode,
    TreePosition,
    current_edge,
    owner_of,
    unlocked_on_path,
)
from runtime.cache.policy_base import EvictionPolicy
from runtime.cache.radix_checks import check_new_slots, check_roots, check_slots, tally_tree
from runtime.cache.tree_events import EdgeStored, LeafEvicted, TreeListener, edge_paths
from runtime.cache.tree_text import tree_text
from runtime.prefix import common_prefix_len

# live namespaces (roots) per owner: past it, a new namespace's tokens are not cached (they stay
# the request's) until one of the owner's namespaces empties
MAX_NAMESPACES_PER_OWNER = 1024


class RadixCacheError(RuntimeError):
    """Misuse of the tree's locking protocol; the tree is unchanged."""


class StalePositionError(RadixCacheError):
    """A TreePosition whose tokens were evicted before it was locked."""


class RadixCache:
    """Prefix cache of KV slot indices keyed by token ids, with locks and leaf-first eviction.

    >>> cache = RadixCache(SlotAllocator(num_slots=64))
    >>> slots = cache.allocator.alloc(3)
    >>> cache.insert([1, 2, 3], slots).prefix_len
    0
    >>> cache.match_prefix([1, 2, 9]).prefix_len
    2
    """

    can_share = True  # inserted prefixes are matched by later requests

    def __init__(
        self,
        allocator: SlotAllocator,
        page_size: int = 1,
        eviction_policy: str | EvictionPolicy = "lru",
        listeners: Iterable[TreeListener] = (),
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.policy = make_eviction_policy(eviction_policy)
        self.num_evicted_tokens = 0
        # told every stored edge, evicted leaf, freed slot and reset (tree_events.py): KV
        # events, demotion to the lower tiers, speculation's token index
        self._listeners = tuple(listeners)
        self._init_tree()

    # ---------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self.evictable_size + self.protected_size

    @property
    def wanted_size(self) -> int:
        """Evictable tokens a known reader needs soon (kept by the policy)."""
        return self.policy.wanted_size

    @property
    def num_candidates(self) -> int:
        """Unlocked leaves, i.e. nodes evict() may take next."""
        return len(self._candidates)

    # ---------------------------------------------------------------- reads
    def match_prefix(self, token_ids: Sequence[int], namespace: Namespace = None) -> MatchResult:
        """Longest cached prefix of `token_ids` (whole pages). Pure: mutates nothing."""
        key = _as_key(token_ids)
        key = key[: len(key) // self.page_size * self.page_size]
        node, pos, values = self._roots.get(namespace, self._absent), 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            matched = self._edge_match_len(child.key, key, pos)
            values.append(child.value if matched == len(child.key) else child.value[:matched])
            pos += matched
            node = child
            if matched < len(child.key):
                break
        return MatchResult(_cat(values), TreePosition(node, pos), pos)

    # ---------------------------------------------------------------- writes
    def insert(
        self,
        token_ids: Sequence[int],
        indices: torch.Tensor,
        namespace: Namespace = None,
        priority: int = 0,
    ) -> InsertResult:
        """Cache `token_ids` -> `indices` (whole pages only).

        The tree takes ownership of `indices[prefix_len:aligned_len]`. The caller keeps the rest:
        it frees its own slots below `prefix_len` (duplicates of the tree's) and any unaligned
        tail. The result's position and indices let the caller lock what it inserted without
        matching again.
        """
        key = _as_key(token_ids)
        if indices.numel() != len(key):
            raise ValueError(f"insert got {len(key)} tokens but {indices.numel()} slot indices")
        aligned_len = len(key) // self.page_size * self.page_size
        key = key[:aligned_len]
        now = self._tick()
        node = self._roots.get(namespace, self._absent)
        pos = 0
        values: list[torch.Tensor] = []
        while pos < aligned_len:
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            matched = self._edge_match_len(child.key, key, pos)
            if matched < len(child.key) and pos + matched < aligned_len:
                child = self._split(child, matched)
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            if child.candidate_seq is not None:
                self._candidates.add(child)  # its key changed: re-order
            values.append(child.value if matched == len(child.key) else child.value[:matched])
            pos += matched
            node = child
            if matched < len(child.key):
                break  # key ends inside this edge: already cached, nothing to split
        prefix_len = pos
        if pos < aligned_len:
            new_indices = indices[pos:aligned_len].to(torch.int64).clone()
            check_new_slots(new_indices, self._slot_in_tree, self.allocator, self.page_size)
            if node is self._absent:  # a namespace's root exists while it holds tokens
                if self._roots_of[owner_of(namespace)] >= MAX_NAMESPACES_PER_OWNER:
                    return InsertResult(0, TreePosition(node, 0), EMPTY_SLOTS)  # caches nothing
                node = self._roots[namespace] = RootNode(namespace, now)
                self._roots_of[owner_of(namespace)] += 1
            above = values[-1] if values else EMPTY_SLOTS
            stored = EdgeStored(namespace, key, pos, new_indices, above)
            node = self._add_leaf(node, stored, now, priority)
            values.append(new_indices)
            pos = aligned_len
        return InsertResult(prefix_len, TreePosition(node, pos), _cat(values))

    def lock(self, where: TreePosition | TreeNode) -> int:
        """Lock the prefix up to `where` (splitting its edge there if needed).

        Returns the change in evictable_size (<= 0); the tokens move to protected_size.
        """
        node = self._node_at(where, split=True)
        now = self._tick()
        delta = 0
        protected = self.policy.protected
        while node.parent is not None:
            if node.lock_ref == 0:
                delta -= len(node.key)
                self._candidates.discard(node)
                protected(node)
            node.lock_ref += 1
            node.hit_count += 1
            node.last_access_time = now
            node = node.parent
        self.evictable_size += delta
        self.protected_size -= delta
        return delta

    def unlock(self, where: TreePosition | TreeNode) -> int:
        """Undo one lock(where). Returns the change in evictable_size (>= 0)."""
        node = self._node_at(where, split=False)
        if node.parent is not None and node.lock_ref == 0:
            raise RadixCacheError(f"unlock of a prefix that is not locked: {node!r}")
        now = self._tick()
        delta = 0
        unprotected = self.policy.unprotected
        while node.parent is not None:
            node.lock_ref -= 1
            node.last_access_time = now
            if node.lock_ref == 0:
                delta += len(node.key)
                unprotected(node)
                if not node.children:
                    self._candidates.add(node)
            node = node.parent
        self.evictable_size += delta
        self.protected_size -= delta
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free `num_tokens` slots (in whole pages) from unlocked leaves, leaf-first, in policy
        order; of the last victim only the tail that is needed goes (its head stays cached and
        is ranked again). Returns how many were freed: fewer only if the unlocked tree is
        smaller."""
        victims: list[TreeNode] = []
        num_evicted = 0
        while num_evicted < num_tokens:
            node = self._candidates.pop()
            if node is None:
                break
            keep = len(node.key) - self._pages_for(num_tokens - num_evicted)
            if keep > 0:  # only the leaf's tail is needed: its head stays cached
                self._split(node, keep)
            victims.append(node)
            num_evicted += len(node.key)
            evicted = LeafEvicted(node)  # told while its slots still hold its KV
            for listener in self._listeners:
                listener.leaf_evicted(evicted)
            parent = self._unlink_leaf(node)
            if parent is not None:
                self._candidates.add(parent)  # a dead branch cascades within this call
        self._release(victims)
        return num_evicted

    def unlocked_tokens(self, position: TreePosition) -> int:
        """Tokens up to a current `position` that no lock holds: what lock(position) moves
        out of evictable_size. Admission counts them as its reader's own: once it is admitted
        they are locked, and so no room for its new tokens."""
        return unlocked_on_path(position.node, position.prefix_len)

    def resolve(self, position: TreePosition) -> TreeNode:
        """The node a (locked, or otherwise split) position ends at exactly."""
        return self._node_at(position, split=False)

    def split_at(self, position: TreePosition) -> TreeNode:
        """The node ending exactly at a current position, its edge split there if needed (a
        reader of the head is then told apart from the tail it does not read)."""
        return self._node_at(position, split=True)

    def slot_indices(self, position: TreePosition) -> torch.Tensor:
        """The slots of the prefix up to a position, read upwards along its path (no key
        compares): for a caller that already holds a current match position."""
        node = self._node_at(position, split=False) if position.prefix_len else None
        values: list[torch.Tensor] = []
        while node is not None and node.parent is not None:
            values.append(node.value)
            node = node.parent
        return _cat(values[::-1])

    def leaves(self):
        """Every node without children (the ends of cached paths)."""
        return (node for node in self._iter_nodes() if not node.children)

    def path_of(self, node: TreeNode) -> tuple[Namespace, tuple[int, ...], torch.Tensor]:
        """The namespace, tokens and slots from the root to the end of `node`'s edge."""
        keys, values = [], []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        path = tuple(t for key in reversed(keys) for t in key)
        return node.namespace, path, _cat(values[::-1])

    def namespace_of(self, node: TreeNode) -> Namespace:
        """The namespace whose tree holds `node`."""
        while node.parent is not None:
            node = node.parent
        return node.namespace

    def match_is_current(self, position: TreePosition, version: int) -> bool:
        """Whether a match that ended at `position` when its node had `version` still holds."""
        return not position.node.evicted and position.node.version == version

    def reprioritize(self, node: TreeNode) -> None:
        """Re-order `node` among the candidates after its policy key changed."""
        if node.candidate_seq is not None:
            self._candidates.add(node)

    def reset(self) -> None:
        """Drop every cached token and return its slots; fails if any prefix is locked."""
        locked = [n for n in self._iter_nodes() if n.lock_ref > 0]
        if locked:
            raise RadixCacheError(f"reset() with {len(locked)} locked nodes, e.g. {locked[0]!r}")
        slots = [n.value for n in self._iter_nodes()]
        if slots:
            self.allocator.free(torch.cat(slots))
        for node in self._iter_nodes():
            node.evicted = True
        self._candidates.clear()
        self._init_tree()
        self.policy.cleared()
        for listener in self._listeners:
            listener.cleared()

    def roots(self) -> dict[Namespace, TreeNode]:
        """Each namespace's root (it holds no tokens; its children are the first edges)."""
        return dict(self._roots)

    def eviction_order(self, limit: int) -> list[TreeNode]:
        """The first `limit` leaves `evict` would take now, in order."""
        return self._candidates.first(limit)

    edge_paths = edge_paths  # the tree as `stored` KV events (tree_events.py)

    # ---------------------------------------------------------------- checks
    def check_integrity(self, num_caller_slots: int | None = None) -> None:
        """Assert every structural invariant; with `num_caller_slots`, also slot conservation."""
        owners = Counter(owner_of(ns) for ns in self._roots if ns is not None)
        check_roots(self._roots, owners, self._roots_of)
        tally = tally_tree(self._roots.values(), self.policy.wanted, self.page_size)
        counted = (tally.evictable, tally.protected, tally.wanted, tally.num_nodes)
        kept = (self.evictable_size, self.protected_size, self.wanted_size, self.num_nodes)
        assert counted == kept, f"evictable, protected, wanted, nodes: {counted=} != {kept=}"
        candidates = {id(n) for n in self._candidates.nodes()}
        assert candidates == tally.candidates, "candidate queue drifted"
        check_slots(_cat(tally.slots), self._slot_in_tree, self.allocator, self.page_size)
        self.allocator.check_integrity()
        for listener in self._listeners:
            listener.check_integrity(self)
        if num_caller_slots is not None:
            accounted = self.allocator.num_free_slots + self.total_size + num_caller_slots
            assert accounted == self.allocator.num_slots, (
                f"slots lost or double-owned: free {self.allocator.num_free_slots} + tree "
                f"{self.total_size} + callers {num_caller_slots} != {self.allocator.num_slots}"
            )

    pretty_print = tree_text  # the tree as text, one node a line (tree_text.py)

    # ---------------------------------------------------------------- internals
    def _init_tree(self) -> None:
        self._clock = 0
        self._roots: dict[Namespace, RootNode] = {None: RootNode(None, 0)}
        # what a read of a namespace without a root sees: no tokens, and "evicted", so a
        # match ending there is never current (it is matched again once the root exists)
        self._absent = RootNode(None, 0)
        self._absent.evicted = True
        self._roots_of: Counter[Namespace] = Counter()  # live namespaces per owner (owner_of)
        self._candidates = CandidateQueue(self.policy)
        self._slot_in_tree = torch.zeros(self.allocator.num_slots, dtype=torch.bool)
        self.evictable_size = 0
        self.protected_size = 0
        self.num_nodes = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: tuple[int, ...], pos: int) -> Hashable:
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def _edge_match_len(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Tokens of `edge` equal to key[pos:], rounded down to whole pages."""
        same = common_prefix_len(edge, key, pos)
        return same - same % self.page_size

    def _node_at(self, where: TreePosition | TreeNode, split: bool) -> TreeNode:
        """The node whose edge ends exactly at `where`, splitting an edge there if `split`."""
        if isinstance(where, TreeNode):
            node, prefix_len = where, where.depth
        else:
            node, prefix_len = where.node, where.prefix_len
        node = current_edge(node, prefix_len)
        if node.parent is None:
            return node  # a root (maybe dropped since): nothing to lock, nothing stale
        if node.evicted:
            raise StalePositionError(f"the prefix at {node!r} was evicted after it was matched")
        if prefix_len == node.depth:
            return node
        offset = prefix_len - (node.depth - len(node.key))
        if not split:
            raise RadixCacheError(f"no lock ends {offset} tokens into {node!r}")
        return self._split(node, offset)

    def _split(self, node: TreeNode, offset: int) -> TreeNode:
        """Cut `node`'s edge after `offset` tokens; the new upper node is returned.

        The lower part keeps its identity (and so every TreePosition into it stays resolvable);
        the upper part inherits lock_ref, so locked paths stay consistent. Only index tensors
        are copied, never KV.
        """
        parent = node.parent
        upper = TreeNode(
            node.key[:offset],
            node.value[:offset].clone(),
            parent,
            node.depth - len(node.key) + offset,
            node.last_access_time,
            node.priority,
        )
        upper.creation_time = node.creation_time
        upper.hit_count = node.hit_count
        upper.lock_ref = node.lock_ref
        self.policy.split(node, upper)
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[offset:]
        node.value = node.value[offset:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        self.num_nodes += 1
        self._bump(node)
        if node.candidate_seq is not None:
            self._candidates.add(node)  # its edge changed: a policy may rank it anew (oracle)
        return upper

    def _add_leaf(self, parent: TreeNode, stored: EdgeStored, now: int, priority: int) -> TreeNode:
        """Hang the new edge under `parent` (which ends where it starts); tell the listeners."""
        key, start = stored.key, stored.start
        leaf = TreeNode(key[start:], stored.slots, parent, len(key), now, priority)
        parent.children[self._child_key(key, start)] = leaf
        self._candidates.discard(parent)
        self._candidates.add(leaf)
        self._slot_in_tree[stored.slots] = True
        self.evictable_size += len(key) - start
        self.num_nodes += 1
        self._bump(leaf)
        for listener in self._listeners:
            listener.edge_stored(stored)
        return leaf

    def _pages_for(self, num_tokens: int) -> int:
        """`num_tokens` rounded up to whole pages."""
        return -(-num_tokens // self.page_size) * self.page_size

    def _bump(self, node: TreeNode) -> None:
        """Mark `node` and its ancestors changed: a cached match ending at any of them may now
        extend (a child was added, or an edge was split). Lets schedulers re-match only the
        waiting requests whose match position actually changed."""
        while node is not None:
            node.version += 1
            node = node.parent

    def _unlink_leaf(self, node: TreeNode) -> TreeNode | None:
        """Detach an evicted leaf; return its parent if that became an unlocked leaf."""
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.evicted = True
        self.num_nodes -= 1
        self.evictable_size -= len(node.key)
        self.policy.removed(node)
        if parent.parent is None:
            if not parent.children and parent.namespace is not None:
                self._drop_root(parent)
            return None
        if not parent.children and parent.lock_ref == 0:
            return parent
        return None

    def _drop_root(self, root: RootNode) -> None:
        """Forget an emptied namespace's root: a client naming a new namespace per request
        must not leave one root (and its name) behind for each. Matches ending at it are no
        longer current (`evicted`), so waiting requests match again."""
        del self._roots[root.namespace]
        root.evicted = True
        owner = owner_of(root.namespace)
        self._roots_of[owner] -= 1
        if not self._roots_of[owner]:
            del self._roots_of[owner]

    def _release(self, victims: list[TreeNode]) -> None:
        """Give evicted leaves' slots back to the allocator in one call."""
        if not victims:
            return
        slots = _cat([victim.value for victim in victims])
        self._slot_in_tree[slots] = False
        self.allocator.free(slots)
        self.num_evicted_tokens += slots.numel()
        for listener in self._listeners:
            listener.slots_freed(slots)

    def _iter_nodes(self):
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    if not values:
        return EMPTY_SLOTS
    return values[0] if len(values) == 1 else torch.cat(values)


def _as_key(token_ids: Sequence[int]) -> tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    return token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
