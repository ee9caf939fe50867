"""KV cache events: what a radix tree stores and removes, as an ordered stream.

A replica's router cannot see its tree; it sees these events. Each one names whole-page token
paths from the root of one namespace's tree:

- ``stored``:  ``token_ids[start_len:]`` became cached under the cached prefix
  ``token_ids[:start_len]``;
- ``removed``: ``token_ids[start_len:]`` (a leaf edge) was evicted; ``token_ids[:start_len]``
  stays cached;
- ``cleared``: every namespace was emptied (``RadixCache.reset``).

Edge splits change no cached token and so emit nothing: a consumer's tree is compared by the
set of cached paths (see `tree_paths`), not by where the engine happens to cut its edges.
Events carry full paths (not vLLM-style chained block hashes) so a consumer needs no hashing
scheme in common with the engine and a path's meaning never depends on an earlier event.

Below the pool (tiers.py), KV lives in chunks named by chained digests (the engine's own
naming), and events say so in vLLM's style: ``medium`` is ``host`` or ``disk`` (``device`` for
the tree above), ``chunks`` lists the hex names stored or removed, and the token fields stay
empty (a chunk's name stands for its whole prefix; `tiers.chunk_names` computes them).

Sequence numbers are global to a publisher and contiguous: a subscriber gets a snapshot taken
at sequence `seq`, then exactly the events `seq + 1, seq + 2, ...`; a gap means loss.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from runtime.cache.tree_events import EdgeStored, LeafEvicted, TreeListener

EventKind = Literal["stored", "removed", "cleared"]
EVENT_KINDS: tuple[str, ...] = ("stored", "removed", "cleared")
MEDIUMS: tuple[str, ...] = ("device", "host", "disk")


class KVEventsLostError(RuntimeError):
    """A subscriber fell more than `max_pending_events` behind; resubscribe for a snapshot."""


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One change to the cached token paths (see the module docstring)."""

    seq: int
    kind: EventKind
    namespace: Hashable = None
    token_ids: tuple[int, ...] = ()
    start_len: int = 0
    medium: str = "device"  # where the KV is: the pool, or a lower tier (host, disk)
    chunks: tuple[str, ...] = ()  # lower tiers: the hex names of the chunks

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (namespaces must then be str or None)."""
        return {
            "seq": self.seq,
            "kind": self.kind,
            "namespace": self.namespace,
            "token_ids": list(self.token_ids),
            "start_len": self.start_len,
            "medium": self.medium,
            "chunks": list(self.chunks),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEvent:
        """Inverse of `to_dict`; rejects unknown kinds."""
        if data["kind"] not in EVENT_KINDS:
            raise ValueError(f"unknown KV event kind {data['kind']!r}; expected {EVENT_KINDS}")
        medium = data.get("medium", "device")
        if medium not in MEDIUMS:
            raise ValueError(f"unknown KV event medium {medium!r}; expected {MEDIUMS}")
        return cls(
            int(data["seq"]),
            data["kind"],
            data.get("namespace"),
            tuple(int(t) for t in data.get("token_ids", ())),
            int(data.get("start_len", 0)),
            medium,
            tuple(str(c) for c in data.get("chunks", ())),
        )


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The cached paths at sequence `seq`, as `stored` events (one per tree edge, parents
    before children); a subscriber applies it, then events from `seq + 1` on."""

    seq: int
    stored: tuple[KVEvent, ...]


class KVEventSubscription:
    """One subscriber's queue: `snapshot`, then `poll()` returns events in order."""

    def __init__(self, snapshot: KVSnapshot, max_pending_events: int, on_close) -> None:
        self.snapshot = snapshot
        self.max_pending_events = max_pending_events
        self.last_seq = snapshot.seq  # the last event pushed (read, or still pending)
        self._events: deque[KVEvent] = deque()
        self._cond = threading.Condition()
        self._lost = False
        self._closed = False
        self._on_close = on_close

    def push(self, event: KVEvent) -> None:
        """Called by the publisher (engine loop thread); never blocks."""
        with self._cond:
            self.last_seq = event.seq
            if len(self._events) >= self.max_pending_events:
                self._lost = True  # keeping more would let a stalled reader exhaust memory
                self._events.clear()
            elif not self._lost:
                self._events.append(event)
            self._cond.notify_all()

    def poll(self, timeout_s: float | None = 0.0) -> list[KVEvent]:
        """Every pending event (waiting up to `timeout_s` for one; None waits for ever)."""
        with self._cond:
            if not self._events and not self._lost and not self._closed and timeout_s != 0.0:
                self._cond.wait(timeout_s)
            if self._lost:
                raise KVEventsLostError(
                    f"more than {self.max_pending_events} KV events were not read; "
                    "subscribe again to get a fresh snapshot"
                )
            events = list(self._events)
            self._events.clear()
            return events

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (or the engine closed)."""
        return self._closed

    def close(self) -> None:
        """Stop receiving events; wakes a waiting `poll`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._on_close(self)


class KVEventPublisher(TreeListener):
    """Numbers events and fans them out to subscriptions. `emit` runs on the thread that
    mutates the tree; `subscribe` must run there too (so the snapshot is consistent).

    It listens to the tree it is built with from the start; with no subscriber, an evicted
    leaf's path is never computed and nothing is built."""

    def __init__(self) -> None:
        self.seq = 0  # the last sequence number issued
        self._subscriptions: list[KVEventSubscription] = []
        self._lock = threading.Lock()  # subscriptions are closed from other threads

    def emit(
        self,
        kind: EventKind,
        namespace: Hashable,
        token_ids,
        start_len: int,
        medium: str = "device",
        chunks: tuple[str, ...] = (),
    ) -> None:
        """Issue the next event to every subscriber."""
        if not self._subscriptions:
            return  # nobody listens: no sequence number is spent, nothing is built
        self.seq += 1
        event = KVEvent(self.seq, kind, namespace, tuple(token_ids), start_len, medium, chunks)
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.push(event)

    # ------------------------------------------------------------ the tree's side
    def edge_stored(self, event: EdgeStored) -> None:
        self.emit("stored", event.namespace, event.key, event.start)

    def leaf_evicted(self, event: LeafEvicted) -> None:
        if self._subscriptions:  # the path is a walk up the tree: only for a listener
            self.emit("removed", event.namespace, event.path, event.start)

    def cleared(self) -> None:
        self.emit("cleared", None, (), 0)

    def subscribe(
        self,
        paths: Iterable[tuple[Hashable, tuple[int, ...], int]],
        max_pending_events: int,
        lower: Iterable[tuple[str, tuple[str, ...]]] = (),
    ) -> KVEventSubscription:
        """A subscription whose snapshot is `paths` ((namespace, path, start_len) per edge)
        and the chunks of the lower tiers ((medium, hex names) per tier)."""
        stored = tuple(KVEvent(self.seq, "stored", ns, ids, start) for ns, ids, start in paths)
        stored += tuple(
            KVEvent(self.seq, "stored", None, (), 0, medium, names)
            for medium, names in lower
            if names
        )
        subscription = KVEventSubscription(
            KVSnapshot(self.seq, stored), max_pending_events, self._remove
        )
        with self._lock:
            self._subscriptions.append(subscription)
        return subscription

    def close_all(self) -> None:
        """Close every subscription (the engine is closing)."""
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.close()

    def _remove(self, subscription: KVEventSubscription) -> None:
        with self._lock:
            if subscription in self._subscriptions:
                self._subscriptions.remove(subscription)
