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
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.eviction import CandidateQueue, EvictionPolicy, make_eviction_policy
from runtime.cache.token_index import TokenIndex
from runtime.prefix import common_prefix_len

Namespace = Hashable  # cache salt / adapter id; None is the default namespace
# live namespaces (roots) per owner: past it, a new namespace's tokens are not cached (they stay
# the request's) until one of the owner's namespaces empties
MAX_NAMESPACES_PER_OWNER = 1024
DemoteSink = Callable[[Namespace, tuple[int, ...], int, torch.Tensor], None]


class RadixCacheError(RuntimeError):
    """Misuse of the tree's locking protocol; the tree is unchanged."""


class StalePositionError(RadixCacheError):
    """A TreePosition whose tokens were evicted before it was locked."""


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
        "future",
        "future_base",
        "reads",
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
        self.future: tuple | None = None  # "graph" policy: known NextUse (set_future)
        self.future_base: tuple | None = None  # ... and what it falls back to when refreshed
        self.reads = 0  # admissions whose cache hit ended exactly here (note_read)

    def __repr__(self) -> str:
        head = ",".join(map(str, self.key[:6])) + ("..." if len(self.key) > 6 else "")
        return f"TreeNode(len={len(self.key)}, key=[{head}], depth={self.depth}, r={self.lock_ref})"


class RootNode(TreeNode):
    """A namespace's root: no tokens, permanently locked, and it knows its namespace (so a
    path's namespace is read off its root, never searched for among all the roots)."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: Namespace, now: int) -> None:
        super().__init__((), _EMPTY, None, 0, now)
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
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size={page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.policy = make_eviction_policy(eviction_policy)
        self.num_evicted_tokens = 0
        # KV events (events.py): called as sink(kind, namespace, token_ids, start_len) at each
        # store / evict / reset; None costs one comparison at those points
        self.event_sink: Callable[[str, Namespace, tuple[int, ...], int], None] | None = None
        # lower KV tiers (tiers.py): called as sink(namespace, path, start_len, path_slots) for
        # each leaf edge evict() takes, while its slots (and its ancestors') still hold its KV
        self.demote_sink: DemoteSink | None = None
        # speculative drafts (token_index.py): told every new edge and every freed slot
        self.token_index: TokenIndex | None = None
        self._init_tree()

    # ---------------------------------------------------------------- sizes
    @property
    def total_size(self) -> int:
        """Tokens held by the tree."""
        return self.evictable_size + self.protected_size

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
            self._check_new_slots(new_indices)
            if node is self._absent:  # a namespace's root exists while it holds tokens
                if self._roots_of[owner_of(namespace)] >= MAX_NAMESPACES_PER_OWNER:
                    return InsertResult(0, TreePosition(node, 0), _EMPTY)  # caches nothing
                node = self._roots[namespace] = RootNode(namespace, now)
                self._roots_of[owner_of(namespace)] += 1
            leaf = TreeNode(key[pos:], new_indices, node, aligned_len, now, priority)
            node.children[self._child_key(key, pos)] = leaf
            self._candidates.discard(node)
            self._candidates.add(leaf)
            self._slot_in_tree[new_indices] = True
            self.evictable_size += aligned_len - pos
            self.num_nodes += 1
            self._bump(leaf)
            if self.event_sink is not None:
                self.event_sink("stored", namespace, key, pos)
            if self.token_index is not None:
                prev_slot = int(values[-1][-1]) if values else -1
                self.token_index.inserted(namespace, key, pos, new_indices.tolist(), prev_slot)
            values.append(new_indices)
            node, pos = leaf, aligned_len
        return InsertResult(prefix_len, TreePosition(node, pos), _cat(values))

    def lock(self, where: TreePosition | TreeNode) -> int:
        """Lock the prefix up to `where` (splitting its edge there if needed).

        Returns the change in evictable_size (<= 0); the tokens move to protected_size.
        """
        node = self._node_at(where, split=True)
        now = self._tick()
        delta = 0
        wanted = self.policy.wanted
        while node.parent is not None:
            if node.lock_ref == 0:
                delta -= len(node.key)
                self._candidates.discard(node)
                if wanted(node):
                    self.wanted_size -= len(node.key)
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
        wanted = self.policy.wanted
        while node.parent is not None:
            node.lock_ref -= 1
            node.last_access_time = now
            if node.lock_ref == 0:
                delta += len(node.key)
                if wanted(node):
                    self.wanted_size += len(node.key)
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
            if self.event_sink is not None:
                self._emit_removed(node)
            if self.demote_sink is not None:
                namespace, path, slots = self.path_of(node)
                self.demote_sink(namespace, path, len(path) - len(node.key), slots)
            parent = self._unlink_leaf(node)
            if parent is not None:
                self._candidates.add(parent)  # a dead branch cascades within this call
        self._release(victims)
        return num_evicted

    def note_read(self, position: TreePosition) -> int:
        """An admission's cache hit ended at (locked) `position`: count it; returns how many
        admissions read this exact prefix so far (a hotness signal; locks count re-locks by
        the same request too)."""
        node = self._node_at(position, split=False)
        node.reads += 1
        return node.reads

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

    def set_future(self, node: TreeNode, future: tuple | None) -> None:
        """Set what the policy knows of `node`'s next use (graph_marks.py), keeping the
        candidate order and `wanted_size` in step."""
        if node.future == future:
            return
        unlocked = node.lock_ref == 0 and not node.evicted
        if unlocked and self.policy.wanted(node):
            self.wanted_size -= len(node.key)
        node.future = future
        if unlocked and self.policy.wanted(node):
            self.wanted_size += len(node.key)
        self.reprioritize(node)

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
        if self.token_index is not None:
            self.token_index.reset()
        if self.event_sink is not None:
            self.event_sink("cleared", None, (), 0)

    def roots(self) -> dict[Namespace, TreeNode]:
        """Each namespace's root (it holds no tokens; its children are the first edges)."""
        return dict(self._roots)

    def eviction_order(self, limit: int) -> list[TreeNode]:
        """The first `limit` leaves `evict` would take now, in order."""
        return self._candidates.first(limit)

    def edge_paths(self):
        """(namespace, path from the root, depth where the edge starts) per edge, parents
        first: the tree as `stored` KV events (a subscriber's snapshot)."""
        for namespace, root in self._roots.items():
            stack = [(child, ()) for child in root.children.values()]
            while stack:
                node, above = stack.pop()
                path = above + node.key
                yield namespace, path, len(above)
                stack.extend((child, path) for child in node.children.values())

    # ---------------------------------------------------------------- checks
    def check_integrity(self, num_caller_slots: int | None = None) -> None:
        """Assert every structural invariant; with `num_caller_slots`, also slot conservation."""
        ps = self.page_size
        evictable = protected = wanted = num_nodes = 0
        candidates: set[int] = set()
        slot_chunks: list[torch.Tensor] = []
        self._check_roots()
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                child_locks = 0
                for ck, child in node.children.items():
                    assert not child.evicted, f"evicted node still linked: {child!r}"
                    assert child.parent is node, f"broken parent link at {child!r}"
                    assert ck == self._child_key(child.key, 0), f"child keyed wrongly: {child!r}"
                    assert len(child.key) > 0 and len(child.key) % ps == 0, f"ragged {child!r}"
                    assert child.value.numel() == len(child.key), f"key/value sizes: {child!r}"
                    assert child.depth == node.depth + len(child.key), f"bad depth: {child!r}"
                    assert child.lock_ref >= 0, f"negative lock_ref: {child!r}"
                    child_locks += child.lock_ref
                    is_candidate = not child.children and child.lock_ref == 0
                    assert (child.candidate_seq is not None) == is_candidate, (
                        f"candidate set wrong at {child!r}"
                    )
                    if is_candidate:
                        candidates.add(id(child))
                    if child.lock_ref:
                        protected += len(child.key)
                    else:
                        evictable += len(child.key)
                        wanted += len(child.key) if self.policy.wanted(child) else 0
                    num_nodes += 1
                    slot_chunks.append(child.value)
                    stack.append(child)
                if node.parent is not None:  # the root's lock is fixed; walks stop below it
                    assert node.lock_ref >= child_locks, f"lock_ref below children's: {node!r}"
        assert evictable == self.evictable_size, f"{evictable=} != {self.evictable_size=}"
        assert protected == self.protected_size, f"{protected=} != {self.protected_size=}"
        assert wanted == self.wanted_size, f"{wanted=} != {self.wanted_size=}"
        assert num_nodes == self.num_nodes, f"{num_nodes=} != {self.num_nodes=}"
        assert {id(n) for n in self._candidates.nodes()} == candidates, "candidate queue drifted"
        slots = torch.cat(slot_chunks) if slot_chunks else _EMPTY
        assert torch.unique(slots).numel() == slots.numel(), "a slot is owned by two nodes"
        assert int(self._slot_in_tree.sum()) == slots.numel(), "slot ownership mask drifted"
        assert bool(self._slot_in_tree[slots].all()), "slot ownership mask drifted"
        assert self.allocator.all_allocated(slots), "the tree holds a free slot"
        if ps > 1 and slots.numel():
            rows = slots.view(-1, ps)
            assert bool((rows[:, 0] % ps == 0).all()), "a node holds a partial page"
            assert bool((rows - rows[:, :1] == torch.arange(ps)).all()), "a page out of order"
        self.allocator.check_integrity()
        if self.token_index is not None:
            self.token_index.check_integrity(self._slot_tokens())
        if num_caller_slots is not None:
            accounted = self.allocator.num_free_slots + self.total_size + num_caller_slots
            assert accounted == self.allocator.num_slots, (
                f"slots lost or double-owned: free {self.allocator.num_free_slots} + tree "
                f"{self.total_size} + callers {num_caller_slots} != {self.allocator.num_slots}"
            )

    def _slot_tokens(self) -> dict[int, int]:
        """Every slot the tree holds -> its token (checks)."""
        held: dict[int, int] = {}
        for node in self._iter_nodes():
            held.update(zip(node.value.tolist(), node.key, strict=True))
        return held

    def pretty_print(
        self,
        file: TextIO | None = None,
        max_tokens: int = 10,
        max_depth: int | None = None,
        max_children: int | None = None,
        render: Callable[[tuple[int, ...]], str] | None = None,
    ) -> str:
        """Write the tree, one node a line: edge length, first tokens (or `render` of them),
        lock_ref; return the text. Deep or wide trees can be cut to a summary."""
        lines = []
        for namespace, root in self._roots.items():
            lines.append(f"[namespace {namespace!r}] r={root.lock_ref}")
            stack = [(child, 1) for child in reversed(self._shown(root, max_children, lines, 1))]
            while stack:
                node, level = stack.pop()
                first = node.key[:max_tokens]
                more = "..." if len(node.key) > max_tokens else ""
                head = repr(render(first)) if render else str(list(first))
                lines.append(f"{'  ' * level}len={len(node.key)} {head}{more} r={node.lock_ref}")
                if max_depth is None or level < max_depth:
                    shown = self._shown(node, max_children, lines, level + 1)
                    stack.extend((c, level + 1) for c in reversed(shown))
                elif node.children:
                    lines.append(f"{'  ' * (level + 1)}... {len(node.children)} children")
        lines.append(
            f"#tokens: {self.total_size} (evictable {self.evictable_size}, protected "
            f"{self.protected_size}), #nodes: {self.num_nodes}"
        )
        text = "\n".join(lines)
        print(text, file=file or sys.stdout)
        return text

    @staticmethod
    def _shown(node: TreeNode, max_children: int | None, lines: list[str], level: int) -> list:
        children = list(node.children.values())
        if max_children is not None and len(children) > max_children:
            lines.append(f"{'  ' * level}({len(children) - max_children} more children hidden)")
            return sorted(children, key=lambda c: -len(c.key))[:max_children]  # longest first
        return children

    # ---------------------------------------------------------------- internals
    def _check_roots(self) -> None:
        """Each root is locked, live and names its namespace; but the default one, each holds
        tokens (an emptied namespace's root is dropped: names cost memory, only KV pays for
        them); the live namespaces per owner are counted right."""
        for namespace, root in self._roots.items():
            assert root.lock_ref == 1 and root.depth == 0 and not root.key, "bad root"
            assert root.namespace == namespace and not root.evicted, f"root of {namespace!r}"
            assert namespace is None or root.children, f"empty root kept: {namespace!r}"
        owners = Counter(owner_of(ns) for ns in self._roots if ns is not None)
        assert owners == self._roots_of, f"namespaces per owner drifted: {self._roots_of}"

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
        self.wanted_size = 0  # evictable tokens the policy says a known reader needs soon
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
        while node.parent is not None and node.parent.depth >= prefix_len:
            node = node.parent  # edges split since the position was taken
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
        upper.reads = node.reads
        upper.lock_ref = node.lock_ref
        unlocked = node.lock_ref == 0
        if unlocked and self.policy.wanted(node):
            self.wanted_size -= offset  # the head moves to `upper`, whose future may differ
        upper.future = upper.future_base = node.future_base  # a reader of node reads upper
        if unlocked and self.policy.wanted(upper):
            self.wanted_size += offset
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
        if self.policy.wanted(node):
            self.wanted_size -= len(node.key)
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
        slots = victims[0].value if len(victims) == 1 else torch.cat([v.value for v in victims])
        self._slot_in_tree[slots] = False
        self.allocator.free(slots)
        self.num_evicted_tokens += slots.numel()
        if self.token_index is not None:
            self.token_index.released(slots.tolist())

    def _check_new_slots(self, indices: torch.Tensor) -> None:
        if not self.allocator.all_allocated(indices):
            raise ValueError("insert got slot indices that are free or outside the pool")
        if bool(self._slot_in_tree[indices].any()):
            raise ValueError("insert got slot indices the tree already holds")
        if self.page_size > 1:
            rows = indices.view(-1, self.page_size)  # (num_pages, page_size)
            first = rows[:, :1]
            if not bool(((first % self.page_size == 0) & (rows - first == _arange(rows))).all()):
                raise ValueError(f"insert needs whole pages of {self.page_size} slots in order")

    def _emit_removed(self, leaf: TreeNode) -> None:
        """Tell the event sink a leaf edge is leaving (before it is unlinked)."""
        keys, node = [], leaf
        while node.parent is not None:
            keys.append(node.key)
            node = node.parent
        path = tuple(t for key in reversed(keys) for t in key)
        self.event_sink("removed", node.namespace, path, len(path) - len(leaf.key))

    def _iter_nodes(self):
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())


_EMPTY = torch.empty(0, dtype=torch.int64)


def owner_of(namespace: Namespace) -> Hashable:
    """Whose a namespace is: its first '/'-separated part (the server puts the API key's tag
    there), the namespace itself if it is no string. Namespaces, hints and remembered program
    branches are bounded per owner."""
    return namespace.split("/", 1)[0] if isinstance(namespace, str) else namespace


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    if not values:
        return _EMPTY
    return values[0] if len(values) == 1 else torch.cat(values)


def _arange(rows: torch.Tensor) -> torch.Tensor:
    return torch.arange(rows.shape[1], dtype=torch.int64)


def _as_key(token_ids: Sequence[int]) -> tuple[int, ...]:
    if isinstance(token_ids, torch.Tensor):
        return tuple(token_ids.tolist())
    return token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
