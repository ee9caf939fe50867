"""Cluster: engine replicas as Ray actors behind a Router, from the driver's side.

Each request is routed, run on its replica's actor, and answered exactly once. If the replica
dies under it (killed, node lost), the replica leaves the router (its tree and pins with it),
and the request is routed again to a live one (a streamed one only if its caller takes back
what it was sent); when Ray has restarted the actor it rejoins, empty. A request no replica
could finish gets an error result of kind "busy" (a 503 over HTTP), never a client error.

A follower thread per replica applies its KV events to the router's tree as they come (a long
poll over Ray that returns at the first event: no polling cadence); a health thread asks each
replica every second whether its engine runs, and has Ray restart one whose engine stopped (or
that stopped answering). A watchdog pings Ray's control store (the GCS) every second: once it
stops answering, `control_lost` says so (the front's /health turns 503 and its server drains
and exits; the replicas keep answering what they run meanwhile).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from runtime.cache.chunks import TierView
from runtime.cluster.event_reader import RemoteKVSubscription
from runtime.cluster.mirror import MirrorDesyncError
from runtime.cluster.policy import RouterConfig
from runtime.cluster.ray_support import gcs_unreachable, init_ray
from runtime.cluster.replica import replica_actor_class
from runtime.cluster.router import NoReplicaError, Router
from runtime.config import EngineConfig
from runtime.errors import EngineClosedError
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    PinInfo,
    ScoreRequest,
    StreamChunk,
)
from runtime.results import error_result
from runtime.scoring import Cancellation
from runtime.summary import EngineSummary
from runtime.telemetry import tracer

EVENT_WAIT_S = 1.0  # a follower's long poll returns at the first event, else after this
REJOIN_POLL_S = 0.5  # how often a dead replica is asked whether Ray restarted it
HEALTH_INTERVAL_S = 1.0  # how often every live replica is asked whether its engine runs
HEALTH_TIMEOUT_S = 30.0  # a replica that does not answer within this is restarted
GCS_PING_INTERVAL_S = 1.0  # how often the watchdog pings Ray's control store
GCS_PING_TIMEOUT_S = 3.0  # one ping's limit: the store answers in milliseconds when up
GCS_MISSES = 2  # pings failed in a row before the store counts as lost (not one slow reply)
GCS_LOST_GRACE_S = 20.0  # at most this to drain once it is lost: Ray ends the driver at 60 s


@dataclass(frozen=True)
class ClusterConfig:
    """How many replicas, how they are routed to, and where Ray is.

    >>> ClusterConfig(num_replicas=2).router.policy
    'cache_aware'
    """

    num_replicas: int = 2
    router: RouterConfig = field(default_factory=RouterConfig)
    ray_address: str | None = None  # None: RAY_ADDRESS, else a local Ray started here
    num_cpus_per_replica: float = 1.0  # CPU engines
    num_gpus_per_replica: float = 1.0  # CUDA engines; 0.5 puts two replicas on one GPU
    max_restarts: int = 3  # Ray restarts a dead replica this often
    max_attempts: int = 3  # runs of one request across replica deaths

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.num_cpus_per_replica <= 0 or self.num_gpus_per_replica <= 0:
            raise ValueError("num_cpus_per_replica and num_gpus_per_replica must be > 0")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


class ClusterPin:
    """A pin held on one replica; `release()` frees it there."""

    def __init__(self, info: PinInfo, release) -> None:
        self.info = info
        self.pin_id = info.pin_id
        self._release = release
        self.released = False

    def release(self) -> None:
        """Unpin (once)."""
        if not self.released:
            self.released = True
            self._release(self.info.pin_id)


class Cluster:
    """N replicas of one engine config behind a router (thread-safe)."""

    def __init__(self, engine_config: EngineConfig, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.engine_config = engine_config
        self._init_replicas()
        self._executor = ThreadPoolExecutor(max_workers=64, thread_name_prefix="cluster")
        self._closed = threading.Event()
        self._followers: list[threading.Thread] = []
        for replica_id in self.actors:
            self._start_follower(replica_id)
        self._health = threading.Thread(target=self._watch_health, name="health", daemon=True)
        self._health.start()
        self.control_lost: str | None = None  # why Ray's control store is gone, once it is
        self._watchdog = threading.Thread(target=self._watch_gcs, name="gcs", daemon=True)
        self._watchdog.start()

    def _init_replicas(self) -> None:
        """Start (or join) Ray, start the actors, and route to each once it has started."""
        config = self.config
        self._ray = init_ray(config.ray_address, None)
        gpu = self.engine_config.device.startswith("cuda")
        actor_class = replica_actor_class(
            0 if gpu else config.num_cpus_per_replica,
            config.num_gpus_per_replica if gpu else 0,
            config.max_restarts,
        )
        settings = self.engine_config.model_dump()
        self.actors = {i: actor_class.remote(settings) for i in range(config.num_replicas)}
        self.router = Router(config.router, self.engine_config.page_size)
        snapshots = self._ray.get([a.snapshot.remote() for a in self.actors.values()])
        described = self._ray.get([a.describe.remote() for a in self.actors.values()])
        for replica_id, snapshot, (_, num_slots) in zip(
            self.actors, snapshots, described, strict=True
        ):
            self.router.add_replica(replica_id, snapshot, num_slots)
        view = self._ray.get(next(iter(self.actors.values())).tier_view.remote())
        if view is not None:  # what lower tiers hold is priced as cheap to load
            self.router.lower_tiers = TierView(*view)
        self.num_reruns = 0  # requests re-run after their replica died
        self.num_restarts = 0  # live actors restarted because their engine stopped
        self._incarnation = dict.fromkeys(self.actors, 0)  # bumped each time one is lost
        self._rejoining: set[int] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        request: GenerateRequest,
        prefer: int | None = None,
        on_chunk: Callable[[StreamChunk], None] | None = None,
        retract: Callable[[], bool] | None = None,
    ) -> Future:
        """Run a request on the routed (or `prefer`red) replica; the future gets one result.
        With `on_chunk`, the replica streams: each chunk is passed on as it arrives. If that
        replica dies after some chunks, `retract()` is asked to take them back: True (nobody
        read them) runs the request again elsewhere, False (or no `retract`) ends it with an
        error result."""
        carrier = tracer().carrier()  # the caller's trace goes with it to the replica's span
        return self._executor.submit(self._generate, request, prefer, on_chunk, retract, carrier)

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Run requests concurrently; results in order."""
        return [f.result() for f in [self.submit(r) for r in requests]]

    def score(
        self, request: ScoreRequest, prefer: int | None = None, cancel: Cancellation | None = None
    ) -> Any:
        """Score continuations on the replica that caches most of the prefix; `cancel` stops
        it there too (ScoreCancelled)."""
        ids = request.prefix if isinstance(request.prefix, list) else []
        rid = f"score-{uuid.uuid4().hex[:12]}"
        if cancel is not None:
            cancel.check()
            cancel.on_cancel(lambda: self._cancel_score(rid))
        return self._call(rid, ids, request.namespace, prefer, "score", request, rid)

    def _cancel_score(self, rid: str) -> None:
        """Tell every live replica (the one running it, or about to) to stop the score."""
        for replica_id in self.router.replica_ids:
            self.actors[replica_id].cancel_score.remote(rid)

    def pin(
        self,
        prefix_ids: list[int],
        namespace: str | None = None,
        hints: GraphHints | None = None,
        prefer: int | None = None,
    ) -> ClusterPin:
        """Pin a prefix on one replica; `replica_of_pin` sends its readers there."""
        rid = f"pin-route-{uuid.uuid4().hex[:12]}"
        program = hints.program_id if hints is not None else None  # the trunk goes home too
        pin_args = (prefix_ids, namespace, hints)
        info, replica_id = self._call(
            rid, prefix_ids, namespace, prefer, "pin", *pin_args, where=True, program=program
        )
        self.router.place_pin(info.pin_id, replica_id, prefix_ids, namespace)
        return ClusterPin(info, self._unpin)

    def replica_of_pin(self, pin_id: str) -> int | None:
        """The replica holding a pin (None once released or its replica died)."""
        return self.router.replica_of_pin(pin_id)

    def _generate(
        self, request: GenerateRequest, prefer: int | None, on_chunk, retract, carrier
    ) -> GenerateResult:
        ids, rid = request.input_ids or [], request.rid
        method = "generate" if on_chunk is None else "generate_stream"
        try:
            return self._call(
                rid,
                ids,
                request.namespace,
                prefer,
                method,
                request,
                carrier,
                on_chunk=on_chunk,
                retract=retract,
                program=request.hints.program_id,
            )
        except NoReplicaError as err:
            return unavailable_result(rid, f"no replica could run the request: {err}")
        except StreamBrokenError as err:
            return unavailable_result(rid, str(err))

    def _call(
        self,
        rid,
        ids,
        namespace,
        prefer,
        method: str,
        *args,
        where: bool = False,
        on_chunk=None,
        retract=None,
        program=None,
    ):
        """Route, call `method` on the replica's actor, re-route if the replica dies (unless
        part of a streamed answer has already gone to the client and `retract` cannot take it
        back: then StreamBrokenError). `program` keeps a program's turns together."""
        ray = self._ray
        for _ in range(self.config.max_attempts):
            replica_id = self.router.route(rid, ids, namespace, prefer, program)
            incarnation = self._incarnation[replica_id]
            streamed = [0]  # chunks passed on
            try:
                call = getattr(self.actors[replica_id], method).remote(*args)
                answer = ray.get(call) if on_chunk is None else _relay(call, on_chunk, streamed)
            except ray.exceptions.RayActorError:  # died (or unreachable) under the request
                self.router.finish(rid)
                self._lost(replica_id)
                if streamed[0] and (retract is None or not retract()):
                    raise StreamBrokenError(
                        f"{rid}: the replica streaming it died after {streamed[0]} chunks; "
                        "the answer so far stands, retry for the rest"
                    ) from None
                prefer = None
                with self._lock:  # callers run on many threads
                    self.num_reruns += 1
                continue
            except ray.exceptions.RayTaskError as err:  # the engine refused it: its own error
                self.router.finish(rid)
                cause = err.as_instanceof_cause()
                if not isinstance(cause, EngineClosedError):
                    raise cause from None
                self._restart(replica_id, incarnation)  # its engine stopped: run it elsewhere
                prefer = None
                with self._lock:
                    self.num_reruns += 1
                continue
            if method == "pin":
                self.router.finish(rid)
                return (answer, replica_id) if where else answer
            result, seq = answer
            self.router.finish(rid, after_seq=seq)
            return result
        raise NoReplicaError(
            f"{rid}: every replica it ran on died ({self.config.max_attempts} runs)"
        )

    def _unpin(self, pin_id: str) -> None:
        replica_id = self.router.replica_of_pin(pin_id)
        self.router.release_pin(pin_id)
        if replica_id is not None and not self._closed.is_set():
            self.actors[replica_id].unpin.remote(pin_id)

    # ---------------------------------------------------------------- replicas
    def stats(self) -> dict[int, dict[str, float]]:
        """Each live replica's engine counters."""
        ids = self.router.replica_ids
        return dict(
            zip(ids, self._ray.get([self.actors[i].stats.remote() for i in ids]), strict=True)
        )

    def cache_views(self, max_nodes: int) -> dict[int, Any]:
        """Each live replica's radix tree, summarised to `max_nodes` nodes."""
        ids = self.router.replica_ids
        views = [self.actors[i].cache_view.remote(max_nodes) for i in ids]
        return dict(zip(ids, self._ray.get(views), strict=True))

    def open_event_reader(self, replica_id: int, max_pending_events: int) -> Any:
        """A RemoteKVSubscription to one live replica's KV events (a snapshot, then every
        event in order), apart from the router's own."""
        if replica_id not in self.router.replica_ids:
            raise NoReplicaError(f"replica {replica_id} is not live")
        actor = self.actors[replica_id]
        reader_id, snapshot = self._ray.get(actor.open_reader.remote(max_pending_events))
        return RemoteKVSubscription(self._ray, actor, reader_id, snapshot)

    def check_integrity(self) -> None:
        """Assert every live replica's engine invariants."""
        ids = self.router.replica_ids
        self._ray.get([self.actors[i].check_integrity.remote() for i in ids])

    def flush_caches(self) -> int:
        """Evict every unlocked cached token on every live replica; how many in all."""
        ids = self.router.replica_ids
        return sum(self._ray.get([self.actors[i].flush_cache.remote() for i in ids]))

    def describe(self, replica_id: int) -> tuple[Any, int]:
        """A replica's model architecture and KV pool size in slots."""
        return self._ray.get(self.actors[replica_id].describe.remote())

    def summary(self, replica_id: int) -> EngineSummary:
        """A replica's startup summary (runtime/summary.py)."""
        return self._ray.get(self.actors[replica_id].summary.remote())

    def abort(self, rid: str) -> None:
        """Abort a request where it runs (nothing if it already finished)."""
        replica_id = self.router.replica_of(rid)
        if replica_id is not None:
            self.actors[replica_id].abort.remote(rid)

    def set_router_config(self, config: RouterConfig) -> None:
        """Route with another policy or thresholds from now on."""
        self.router.config = config

    def wait_for_events(self, timeout_s: float = 10.0) -> None:
        """Block until the router's trees have caught up with every live replica's events."""
        deadline = time.monotonic() + timeout_s
        ids = self.router.replica_ids
        snapshots = self._ray.get([self.actors[i].peek_snapshot.remote() for i in ids])
        for replica_id, snapshot in zip(ids, snapshots, strict=True):
            while self.router.tree(replica_id).last_seq < snapshot.seq:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"replica {replica_id}'s events did not arrive in time")
                time.sleep(0.01)

    def _lost(self, replica_id: int) -> None:
        """A replica died: stop routing to it; watch for Ray's restart to let it rejoin."""
        with self._lock:
            dropped = self._drop(replica_id)
        if dropped:
            self._await_rejoin(replica_id)

    def _restart(self, replica_id: int, incarnation: int) -> None:
        """A replica's engine stopped while its actor lives on: have Ray restart the actor
        (killed with restarts allowed, it comes back with a fresh engine and rejoins).
        `incarnation` is the one that said so: a late answer never kills its successor, and
        two that say so at once (the health check, a refused request) restart it once."""
        with self._lock:
            if self._incarnation[replica_id] != incarnation:
                return
            if replica_id not in self.router.replica_ids:
                return  # already lost: its rejoin is being watched
            self.num_restarts += 1
            self._ray.kill(self.actors[replica_id], no_restart=False)
            self._drop(replica_id)  # under the same lock: the next caller sees it gone
        self._await_rejoin(replica_id)

    def _drop(self, replica_id: int) -> bool:
        """Stop routing to a replica and bump its incarnation (the caller holds the lock);
        False if it was not routed to."""
        if replica_id not in self.router.replica_ids:
            return False
        self.router.remove_replica(replica_id)
        self._rejoining.add(replica_id)
        self._incarnation[replica_id] += 1
        return True

    def _watch_health(self) -> None:
        """Ask every live replica whether its engine runs; restart one that says no or does
        not answer in time (a dead actor is found by the calls and the event pump too)."""
        ray = self._ray
        while not self._closed.wait(HEALTH_INTERVAL_S):
            ids = self.router.replica_ids
            incarnations = [self._incarnation[i] for i in ids]
            checks = [self.actors[i].health.remote() for i in ids]
            for replica_id, incarnation, check in zip(ids, incarnations, checks, strict=True):
                try:
                    healthy = ray.get(check, timeout=HEALTH_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    healthy = False
                except ray.exceptions.RayActorError:
                    healthy = True  # dead, not stopped: Ray restarts it; _lost follows it
                if not healthy and not self._closed.is_set():
                    self._restart(replica_id, incarnation)

    def _watch_gcs(self) -> None:
        """Ping Ray's control store; after GCS_MISSES failed pings in a row, say it is lost.
        Actor calls go straight to the replicas, so what runs finishes; nothing new can be
        placed, restarted or killed through Ray."""
        misses = 0
        while not self._closed.wait(GCS_PING_INTERVAL_S):
            problem = gcs_unreachable(self._ray, GCS_PING_TIMEOUT_S)
            misses = misses + 1 if problem is not None else 0
            if misses >= GCS_MISSES:
                self.control_lost = f"Ray's control store (GCS) does not answer: {problem}"
                return

    def _await_rejoin(self, replica_id: int) -> None:
        threading.Thread(target=self._rejoin, args=(replica_id,), daemon=True).start()

    def _rejoin(self, replica_id: int) -> None:
        ray = self._ray
        while not self._closed.is_set():
            try:
                snapshot = ray.get(self.actors[replica_id].snapshot.remote())
                _, num_slots = ray.get(self.actors[replica_id].describe.remote())
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                time.sleep(REJOIN_POLL_S)  # not restarted yet (or for good: max_restarts)
                continue
            with self._lock:
                self.router.add_replica(replica_id, snapshot, num_slots)
                self._rejoining.discard(replica_id)
            self._start_follower(replica_id)
            return

    def _start_follower(self, replica_id: int) -> None:
        incarnation = self._incarnation[replica_id]
        follower = threading.Thread(
            target=self._follow, args=(replica_id, incarnation), name=f"kv-events-{replica_id}"
        )
        follower.daemon = True
        self._followers.append(follower)
        follower.start()

    def _follow(self, replica_id: int, incarnation: int) -> None:
        """Apply one replica's KV events to its router tree as they come, until the cluster
        closes or this incarnation of the replica is lost (its successor gets a new one)."""
        ray = self._ray
        while not self._closed.is_set() and self._incarnation[replica_id] == incarnation:
            try:
                events = ray.get(self.actors[replica_id].poll_events.remote(EVENT_WAIT_S))
                if events is not None:
                    self.router.apply_events(replica_id, events)
                    continue
            except MirrorDesyncError:
                pass  # a gap: resync below
            except ray.exceptions.RayTaskError:  # its engine stopped: the health check acts
                self._closed.wait(REJOIN_POLL_S)
                continue
            except ray.exceptions.RayActorError:
                self._lost(replica_id)
                return
            try:
                self._resync(replica_id)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                self._closed.wait(REJOIN_POLL_S)

    def _resync(self, replica_id: int) -> None:
        snapshot = self._ray.get(self.actors[replica_id].snapshot.remote())
        if replica_id in self.router.replica_ids:
            self.router.resync(replica_id, snapshot)

    def close(self) -> None:
        """Stop the pump and the replicas (Ray itself is left running)."""
        if self._closed.is_set():
            return
        self._closed.set()
        for follower in self._followers:
            follower.join(timeout=EVENT_WAIT_S + 5)
        self._health.join(timeout=5)
        self._watchdog.join(timeout=GCS_PING_TIMEOUT_S + 5)
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.control_lost is not None:
            return  # killing goes through the lost store; the replicas end with this driver
        for actor in self.actors.values():
            self._ray.kill(actor, no_restart=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unavailable_result(rid: str, message: str) -> GenerateResult:
    """The result of a request the cluster could not finish (its replicas died): kind "busy",
    a 503 over HTTP, since the same request may succeed once the replicas are back."""
    return error_result(rid, message).model_copy(update={"error_kind": "busy"})


class StreamBrokenError(RuntimeError):
    """A replica died after part of a streamed answer reached the client: it cannot be re-run
    elsewhere without repeating what was sent."""


def _relay(stream, on_chunk: Callable[[StreamChunk], None], streamed: list[int]) -> Any:
    """Pass a replica's streamed chunks on as they arrive; return its final answer."""
    import ray

    answer = None
    for ref in stream:
        kind, value = ray.get(ref)
        if kind == "chunk":
            on_chunk(value)
            streamed[0] += 1
        else:
            answer = value
    return answer
