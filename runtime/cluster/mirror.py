"""A replica's radix tree as the router knows it: rebuilt from its KV event stream.

Token paths only (no slots, no locks). Edges are cut where events make them, not where the
engine cut its own (a lock splits an engine edge without an event), so two trees are compared
by their leaf paths (`leaf_paths`), which determine every cached path.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from runtime.cache.events import KVEvent, KVSnapshot
from runtime.prefix import common_prefix_len


class MirrorDesyncError(RuntimeError):
    """An event does not fit the mirror (a lost or reordered event): resubscribe."""


class _Edge:
    __slots__ = ("key", "children", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Edge | None) -> None:
        self.key = key
        self.children: dict[Hashable, _Edge] = {}  # the child's first page (see _page) -> child
        self.parent = parent


class MirrorTree:
    """Cached token paths per namespace, fed by KV events in sequence order.

    >>> tree = MirrorTree()
    >>> tree.apply(KVEvent(1, "stored", None, (1, 2, 3, 4), 0))
    >>> tree.match_len([1, 2, 9])
    2
    """

    def __init__(self, page_size: int = 1) -> None:
        self.page_size = page_size
        self.last_seq = 0
        self.num_tokens = 0
        self._roots: dict[Hashable, _Edge] = {}
        # the replica's lower KV tiers: medium -> hex names of the chunks held there
        self.lower: dict[str, set[str]] = {"host": set(), "disk": set()}

    def load(self, snapshot: KVSnapshot) -> None:
        """Replace the contents with a subscription's snapshot."""
        self._roots.clear()
        self.num_tokens = 0
        for chunks in self.lower.values():
            chunks.clear()
        for event in snapshot.stored:
            if event.medium == "device":
                self._store(event.namespace, event.token_ids, event.start_len)
            else:
                self.lower[event.medium].update(event.chunks)
        self.last_seq = snapshot.seq

    def apply(self, event: KVEvent) -> None:
        """Apply the next event; its seq must follow the last one applied."""
        if event.seq != self.last_seq + 1:
            raise MirrorDesyncError(f"event seq {event.seq} after {self.last_seq}: events lost")
        if event.medium != "device":
            chunks = self.lower[event.medium]
            if event.kind == "stored":
                chunks.update(event.chunks)
            else:
                chunks.difference_update(event.chunks)
        elif event.kind == "stored":
            self._store(event.namespace, event.token_ids, event.start_len)
        elif event.kind == "removed":
            self._remove(event.namespace, event.token_ids, event.start_len)
        else:
            self._roots.clear()
            self.num_tokens = 0
        self.last_seq = event.seq

    def apply_all(self, events: Iterable[KVEvent]) -> None:
        """Apply events in order."""
        for event in events:
            self.apply(event)

    def match_len(self, token_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Tokens of `token_ids` cached on the replica (whole pages)."""
        key = tuple(token_ids)
        node, pos = self._roots.get(namespace), 0
        while node is not None and pos < len(key):
            child = node.children.get(self._page(key, pos))
            if child is None:
                break
            matched = self._match(child.key, key, pos)
            pos += matched
            if matched < len(child.key):
                break
            node = child
        return pos

    def insert(self, token_ids: Sequence[int], namespace: Hashable = None) -> None:
        """Add a path directly (no event): the `approximate` policy's guess of what a replica
        caches after it was sent a prompt, as SGLang's router keeps it."""
        key = tuple(token_ids)
        key = key[: len(key) - len(key) % self.page_size]
        matched = self.match_len(key, namespace)
        if matched < len(key):
            self._store(namespace, key, matched)

    def leaf_paths(self) -> dict[Hashable, frozenset[tuple[int, ...]]]:
        """Per non-empty namespace, the set of maximal cached paths (canonical form)."""
        paths: dict[Hashable, frozenset[tuple[int, ...]]] = {}
        for namespace, root in self._roots.items():
            leaves, stack = set(), [(child, ()) for child in root.children.values()]
            while stack:
                node, above = stack.pop()
                path = above + node.key
                if not node.children:
                    leaves.add(path)
                stack.extend((child, path) for child in node.children.values())
            if leaves:
                paths[namespace] = frozenset(leaves)
        return paths

    # ---------------------------------------------------------------- internals
    def _walk(self, namespace: Hashable, key: tuple[int, ...], split: bool) -> _Edge:
        """The edge ending exactly `len(key)` tokens deep along `key` (split there if asked)."""
        node = self._roots.setdefault(namespace, _Edge((), None))
        pos = 0
        while pos < len(key):
            child = node.children.get(self._page(key, pos))
            matched = 0 if child is None else self._match(child.key, key, pos)
            if matched == 0:
                raise MirrorDesyncError(f"path of {len(key)} tokens is not cached at {pos}")
            if matched < len(child.key):
                if not split or pos + matched < len(key):
                    raise MirrorDesyncError(f"path diverges {pos + matched} tokens deep")
                child = self._split(child, matched)
            pos += matched
            node = child
        return node

    def _page(self, key: tuple[int, ...], pos: int) -> Hashable:
        """A child's dict key: its first page (siblings may share a first token when pages
        are longer than one token)."""
        return key[pos] if self.page_size == 1 else key[pos : pos + self.page_size]

    def _match(self, edge: tuple[int, ...], key: tuple[int, ...], pos: int) -> int:
        """Tokens of `edge` equal to key[pos:], in whole pages."""
        same = common_prefix_len(edge, key, pos)
        return same - same % self.page_size

    def _split(self, node: _Edge, offset: int) -> _Edge:
        upper = _Edge(node.key[:offset], node.parent)
        node.parent.children[self._page(upper.key, 0)] = upper
        node.key = node.key[offset:]
        node.parent = upper
        upper.children[self._page(node.key, 0)] = node
        return upper

    def _store(self, namespace: Hashable, token_ids: tuple[int, ...], start_len: int) -> None:
        parent = self._walk(namespace, token_ids[:start_len], split=True)
        new = token_ids[start_len:]
        if not new or len(new) % self.page_size or self._page(new, 0) in parent.children:
            raise MirrorDesyncError(f"stored {len(new)} tokens: empty, ragged or already cached")
        parent.children[self._page(new, 0)] = _Edge(new, parent)
        self.num_tokens += len(new)

    def _remove(self, namespace: Hashable, token_ids: tuple[int, ...], start_len: int) -> None:
        node = self._walk(namespace, token_ids, split=False)
        if node.children:
            raise MirrorDesyncError("removed a path that still has cached children")
        num_left = len(token_ids) - start_len
        while num_left > 0:
            parent = node.parent
            if parent is None or node.children:
                raise MirrorDesyncError("removed more tokens than the leaf edge holds")
            if len(node.key) > num_left:  # the engine had an edge boundary we never saw
                node.key = node.key[: len(node.key) - num_left]
                self.num_tokens -= num_left
                return
            del parent.children[self._page(node.key, 0)]
            num_left -= len(node.key)
            self.num_tokens -= len(node.key)
            node = parent
