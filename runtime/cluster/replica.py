"""One replica: an Engine inside a Ray actor, with its KV event subscription.

The class is plain Python (testable in-process); `replica_actor_class` wraps it with
`ray.remote`. The actor is threaded (`max_concurrency`): the Engine is thread-safe, and a long
`generate` must not hold up event polling or health checks.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

from runtime.cache.events import KVEvent, KVEventsLostError, KVEventSubscription, KVSnapshot
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import EngineClosedError
from runtime.handles import PinHandle
from runtime.protocol import GenerateRequest, GenerateResult, GraphHints, PinInfo, ScoreRequest
from runtime.scoring import Cancellation
from runtime.summary import EngineSummary
from runtime.telemetry import tracer

ACTOR_MAX_CONCURRENCY = 64  # calls in flight per replica (requests, polls, health checks)


class Replica:
    """An engine plus what a router needs from it: events, load, health."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.engine = Engine(EngineConfig(**config))
        self._subscription = self.engine.subscribe_kv_events()
        self._pins: dict[str, PinHandle] = {}
        self._scores: dict[str, Cancellation] = {}  # running scores, by the cluster's id
        self._readers: dict[str, KVEventSubscription] = {}  # the front's event streams
        self._lock = threading.Lock()

    def snapshot(self) -> KVSnapshot:
        """A fresh subscription's snapshot (the router resyncs with it); older events end.
        A stopped engine has none to give: the router must not take it back before Ray has
        restarted the actor (the restart lands a moment after the kill)."""
        if not self.engine.is_alive:
            raise EngineClosedError("this replica's engine stopped; it awaits its restart")
        self._subscription.close()
        self._subscription = self.engine.subscribe_kv_events()
        return self._subscription.snapshot

    def peek_snapshot(self) -> KVSnapshot:
        """The tree as a snapshot, leaving the router's subscription alone (for checks)."""
        subscription = self.engine.subscribe_kv_events()
        subscription.close()
        return subscription.snapshot

    def flush_cache(self) -> int:
        """Evict every unlocked cached token (between benchmark runs)."""
        return self.engine.flush_cache()

    def poll_events(self, timeout_s: float) -> list[KVEvent] | None:
        """Pending KV events, returned at the first one (or after `timeout_s` with none);
        None if the router fell behind and must call `snapshot`. A stopped engine raises
        (its closed subscription would answer at once, and the router would spin)."""
        if not self.engine.is_alive:
            raise EngineClosedError("this replica's engine stopped; it awaits its restart")
        return _poll(self._subscription, timeout_s)

    def open_reader(self, max_pending_events: int) -> tuple[str, KVSnapshot]:
        """Another subscription to this replica's events (a client of the front's
        /v1/flowlang/kv_events), apart from the router's: its id and snapshot."""
        subscription = self.engine.subscribe_kv_events(max_pending_events)
        reader_id = uuid.uuid4().hex
        with self._lock:
            self._readers[reader_id] = subscription
        return reader_id, subscription.snapshot

    def poll_reader(self, reader_id: str, timeout_s: float) -> list[KVEvent] | None:
        """A reader's pending events (as `poll_events`); None once it fell behind or was
        closed (the engine stopped): the reader subscribes again."""
        with self._lock:
            subscription = self._readers.get(reader_id)
        if subscription is None or subscription.closed:
            return None
        return _poll(subscription, timeout_s)

    def close_reader(self, reader_id: str) -> None:
        """End a reader's subscription (unknown ids are ignored)."""
        with self._lock:
            subscription = self._readers.pop(reader_id, None)
        if subscription is not None:
            subscription.close()

    def generate(
        self, request: GenerateRequest, carrier: dict[str, str] | None = None
    ) -> tuple[GenerateResult, int]:
        """Run one request; also return the event seq that covers its insert into the tree.
        `carrier`: the caller's trace context (W3C headers), its span's parent here."""
        with tracer().attached(carrier):
            (result,) = self.engine.generate(request)
        return result, self._subscription.last_seq

    def generate_stream(
        self, request: GenerateRequest, carrier: dict[str, str] | None = None
    ) -> Iterator[tuple[str, Any]]:
        """Run one request, yielding ("chunk", StreamChunk) as its tokens come (a Ray
        generator: each reaches the caller at once), then ("result", (result, event seq))."""
        with tracer().attached(carrier):
            handle = self.engine.submit(request)
        for chunk in handle.chunks():
            yield "chunk", chunk
        yield "result", (handle.result(), self._subscription.last_seq)

    def score(self, request: ScoreRequest, score_id: str) -> tuple[Any, int]:
        """Score continuations (`cancel_score(score_id)` stops it); also return the event seq
        after it."""
        cancel = Cancellation()
        with self._lock:
            self._scores[score_id] = cancel
        try:
            (result,) = self.engine.score(request, cancel)
        finally:
            with self._lock:
                del self._scores[score_id]
        return result, self._subscription.last_seq

    def cancel_score(self, score_id: str) -> None:
        """Stop a score running here (its client went away); unknown ids are ignored."""
        with self._lock:
            cancel = self._scores.get(score_id)
        if cancel is not None:
            cancel.cancel()

    def pin(
        self, prefix_ids: list[int], namespace: str | None, hints: GraphHints | None
    ) -> PinInfo:
        """Pin a prefix here; the router sends the pin's readers to this replica."""
        handle = self.engine.pin(prefix_ids, namespace, hints)
        self._pins[handle.info.pin_id] = handle
        return handle.info

    def unpin(self, pin_id: str) -> None:
        """Release a pin (unknown ids are ignored: the pin died with an earlier incarnation)."""
        handle = self._pins.pop(pin_id, None)
        if handle is not None:
            handle.release()

    def describe(self) -> tuple[Any, int]:
        """The model's architecture and the KV pool's size in slots (for a router front)."""
        return self.engine.arch, self.engine.num_slots

    def tier_view(self) -> tuple[str | None, bytes, int] | None:
        """How its lower KV tiers name chunks and where their disk is (runtime/cache/chunks
        TierView); None without lower tiers. Replicas of one config name alike, share the disk."""
        view = self.engine.tier_view()  # None: no disk tier to share
        return None if view is None else view.describe()

    def summary(self) -> EngineSummary:
        """The engine's startup summary (runtime/summary.py)."""
        return self.engine.summary()

    def abort(self, rid: str) -> None:
        """Abort a request running here."""
        self.engine.abort(rid)

    def stats(self) -> dict[str, float]:
        """The engine's counters."""
        return self.engine.stats()

    def cache_view(self, max_nodes: int) -> Any:
        """The engine's radix tree, summarised (runtime/cache/view.py)."""
        return self.engine.cache_view(max_nodes)

    def check_integrity(self) -> None:
        """Assert the engine's invariants."""
        self.engine.check_integrity()

    def health(self) -> bool:
        """Whether the engine's loop runs."""
        return self.engine.is_alive

    def placement(self) -> dict[str, Any]:
        """Where Ray put this replica: node, the GPUs it was given, the engine's device."""
        from runtime.cluster.ray_support import require_ray

        context = require_ray().get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "gpu_ids": [str(i) for i in context.get_accelerator_ids().get("GPU", [])],
            "device": self.engine.config.device,
        }

    def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop the engine: new requests are refused (the cluster runs them elsewhere), those
        in flight get up to `drain_timeout_s` to finish; then the cluster's health check has
        Ray restart this actor with a fresh engine (recycling a replica)."""
        self.engine.close(drain_timeout_s)


def _poll(subscription: KVEventSubscription, timeout_s: float) -> list[KVEvent] | None:
    """A subscription's pending events; None once its reader fell behind."""
    try:
        return subscription.poll(timeout_s)
    except KVEventsLostError:
        return None


def replica_actor_class(num_cpus: float, num_gpus: float, max_restarts: int):
    """`Replica` as a Ray actor class with these resources (Ray restarts a dead one)."""
    from runtime.cluster.ray_support import require_ray

    ray = require_ray()
    return ray.remote(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_restarts=max_restarts,
        max_concurrency=ACTOR_MAX_CONCURRENCY,
    )(Replica)
