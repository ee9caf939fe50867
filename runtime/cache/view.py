"""A snapshot of the radix tree for people: the largest subtrees, each node's size in tokens, who
holds it (pins, running requests) and what eviction knows of it.

`build_cache_view` reads a live cache on the engine's loop thread and returns plain frozen
data; `CacheView` then draws itself (`to_svg`, Jupyter's `_repr_svg_`) or becomes JSON
(`to_dict`, the dashboard) on any thread. Large trees are summarised: the `max_nodes` nodes
with the largest subtrees are kept, and every node says how much it hides below it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from runtime.cache.graph_policy import CONTINUATION, QUEUED_READ, RETURNING

NEXT_USE_WORDS = {
    RETURNING: "continuation",
    CONTINUATION: "continuation",
    QUEUED_READ: "queued read",
}


@dataclass(frozen=True)
class NodeView:
    """One edge of the tree."""

    num_tokens: int
    depth_tokens: int  # tokens from the root to the end of this edge
    label: str  # the edge's first tokens: decoded text as a Python literal, else the ids
    lock_ref: int  # requests and pins holding it (SGLang's lock_ref)
    num_pins: int  # pins whose prefix runs through it (a fork's or a batch's shared prefix)
    next_use: str | None  # what the "graph" eviction policy knows: "queued read", ...
    evict_rank: int | None  # 1: the leaf eviction takes first; None: not a candidate
    children: tuple[NodeView, ...]
    hidden_nodes: int  # nodes below this one that the view leaves out
    hidden_tokens: int

    @property
    def state(self) -> str:
        """ "pinned" (a pin holds it), "locked" (a running request does) or "evictable"."""
        return "pinned" if self.num_pins else "locked" if self.lock_ref else "evictable"


@dataclass(frozen=True)
class NamespaceView:
    namespace: str  # repr of the cache namespace (None is the default one)
    children: tuple[NodeView, ...]  # the root's shown children
    hidden_nodes: int
    hidden_tokens: int
    replica: int | None = None  # whose tree, behind a router front (merge_views)


@dataclass(frozen=True)
class PinnedAt:
    """What the picture reads of a pin: where it holds the tree (None: nowhere yet)."""

    lock_pos: Any
    namespace: str | None


@dataclass(frozen=True)
class PinView:
    pin_id: str
    num_tokens: int
    namespace: str


@dataclass(frozen=True)
class CacheView:
    """The tree at one moment: its shown part, its totals and the pins."""

    namespaces: tuple[NamespaceView, ...]
    pins: tuple[PinView, ...]
    total_tokens: int
    evictable_tokens: int
    protected_tokens: int
    num_nodes: int
    capacity_tokens: int  # KV slots in the pool
    policy: str  # the eviction policy's name
    host_tokens: int = 0  # below the pool (tiers.py): in host memory
    disk_tokens: int = 0  # ... and on disk

    @property
    def num_shown(self) -> int:
        return sum(1 for _ in self.nodes())

    def nodes(self) -> Iterable[NodeView]:
        """Every shown node, parents first."""
        stack = [n for ns in self.namespaces for n in reversed(ns.children)]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children))

    def to_svg(self, width_px: int = 960) -> str:
        from runtime.cache.picture import cache_svg  # drawing is only loaded when asked for

        return cache_svg(self, width_px)

    def _repr_svg_(self) -> str:  # Jupyter
        return self.to_svg()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_cache_view(
    cache: Any,
    pins: Mapping[str, PinnedAt],
    render: Callable[[tuple[int, ...]], str] | None = None,
    max_nodes: int = 40,
    label_tokens: int = 8,
    max_ranked: int = 8,
    below: Mapping[str, float] | None = None,
) -> CacheView:
    """Snapshot `cache` (a PrefixCache, read on its owning thread). `pins` maps pin ids
    to where they hold the tree (PinnedAt); `render`
    decodes token ids; `below` is the lower tiers' stats (KVTiers.stats), if any."""
    snapshot = _Snapshot(cache, render, label_tokens)
    pin_views = [snapshot.add_pin(pin_id, pin) for pin_id, pin in pins.items()]
    snapshot.choose(max_nodes)
    snapshot.ranks = {id(n): i + 1 for i, n in enumerate(cache.eviction_order(max_ranked))}
    return CacheView(
        namespaces=tuple(
            NamespaceView(repr(namespace), *snapshot.shown_below(root))
            for namespace, root in snapshot.roots.items()
        ),
        pins=tuple(pin_views),
        total_tokens=cache.total_size,
        evictable_tokens=cache.evictable_size,
        protected_tokens=cache.protected_size,
        num_nodes=cache.num_nodes,
        capacity_tokens=cache.allocator.num_slots,
        policy=getattr(getattr(cache, "policy", None), "name", "none"),
        host_tokens=int((below or {}).get("kv_host_tokens", 0)),
        disk_tokens=int((below or {}).get("kv_disk_tokens", 0)),
    )


class _Snapshot:
    """What a view needs of the live tree: subtree sizes, the shown set, pins, ranks."""

    def __init__(self, cache: Any, render, label_tokens: int) -> None:
        self.cache = cache
        self.render = render
        self.label_tokens = label_tokens
        self.roots = cache.roots()
        self.sizes = _subtree_sizes(self.roots.values())
        self.pinned: dict[int, int] = {}  # node id -> pins through it
        self.pinned_paths: list[Any] = []  # pinned nodes, each after its parent
        self.shown: set[int] = set()
        self.ranks: dict[int, int] = {}  # node id -> place in eviction order

    def choose(self, max_nodes: int) -> None:
        """Pick the shown nodes: pinned paths first, then the largest subtrees."""
        self.shown = _largest_subtrees(
            self.roots.values(), self.sizes, max_nodes, self.pinned_paths
        )

    def add_pin(self, pin_id: str, pin: PinnedAt) -> PinView:
        node = self.cache.resolve(pin.lock_pos) if pin.lock_pos is not None else None
        view = PinView(pin_id, node.depth if node else 0, repr(pin.namespace))
        path = []
        while node is not None and node.parent is not None:
            self.pinned[id(node)] = self.pinned.get(id(node), 0) + 1
            path.append(node)
            node = node.parent
        self.pinned_paths += reversed(path)
        return view

    def shown_below(self, node: Any) -> tuple[tuple[NodeView, ...], int, int]:
        """Views of `node`'s shown children (largest first), and what is hidden below it."""
        kept = [c for c in node.children.values() if id(c) in self.shown]
        kept.sort(key=lambda c: -self.sizes[id(c)][1])
        return (tuple(self.view(c) for c in kept), *_hidden(node, self.shown, self.sizes))

    def view(self, node: Any) -> NodeView:
        head = tuple(node.key[: self.label_tokens])
        label = repr(self.render(head)) if self.render is not None else " ".join(map(str, head))
        future = self.cache.policy.future(node)  # a NextUse, if the policy knows one
        return NodeView(
            len(node.key),
            node.depth,
            label + ("\u2026" if len(node.key) > self.label_tokens else ""),
            node.lock_ref,
            self.pinned.get(id(node), 0),
            NEXT_USE_WORDS.get(future.kind) if future is not None else None,
            self.ranks.get(id(node)),
            *self.shown_below(node),
        )


def merge_views(views: Mapping[int, CacheView]) -> CacheView:
    """Several replicas' views as one: each namespace tagged with its replica, totals summed."""
    parts = list(views.values())
    return CacheView(
        namespaces=tuple(
            replace(ns, replica=replica) for replica, v in views.items() for ns in v.namespaces
        ),
        pins=tuple(pin for v in parts for pin in v.pins),
        total_tokens=sum(v.total_tokens for v in parts),
        evictable_tokens=sum(v.evictable_tokens for v in parts),
        protected_tokens=sum(v.protected_tokens for v in parts),
        num_nodes=sum(v.num_nodes for v in parts),
        capacity_tokens=sum(v.capacity_tokens for v in parts),
        policy=parts[0].policy if parts else "none",
        host_tokens=sum(v.host_tokens for v in parts),
        disk_tokens=sum(v.disk_tokens for v in parts),
    )


def _subtree_sizes(roots: Iterable[Any]) -> dict[int, tuple[int, int]]:
    """(nodes, tokens) of each node's subtree, itself included; iterative (deep trees)."""
    order = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    sizes: dict[int, tuple[int, int]] = {}
    for node in reversed(order):  # children before parents
        nodes, tokens = 1, len(node.key)
        for child in node.children.values():
            n, t = sizes[id(child)]
            nodes, tokens = nodes + n, tokens + t
        sizes[id(node)] = (nodes, tokens)
    return sizes


def _largest_subtrees(
    roots: Iterable[Any], sizes: dict[int, tuple[int, int]], max_nodes: int, first: list[Any]
) -> set[int]:
    """Ids of up to `max_nodes` nodes, each shown with its parent: the nodes of `first`
    (parents before children), then the largest subtrees."""
    kept = list({id(n): n for n in first}.values())[:max_nodes]  # dict: once each, in order
    shown = {id(n) for n in kept}
    frontier = [c for r in roots for c in r.children.values()]
    frontier += [c for n in kept for c in n.children.values()]
    seq = itertools.count()
    heap = [(-sizes[id(c)][1], next(seq), c) for c in frontier if id(c) not in shown]
    heapq.heapify(heap)
    while heap and len(shown) < max_nodes:
        _, _, node = heapq.heappop(heap)
        shown.add(id(node))
        for child in node.children.values():
            heapq.heappush(heap, (-sizes[id(child)][1], next(seq), child))
    return shown


def _hidden(node: Any, shown: set[int], sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nodes, tokens) in the subtrees of `node`'s children that are not shown."""
    nodes = tokens = 0
    for child in node.children.values():
        if id(child) not in shown:
            n, t = sizes[id(child)]
            nodes, tokens = nodes + n, tokens + t
    return nodes, tokens
