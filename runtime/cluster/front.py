"""ClusterEngine: the engine's surface (runtime/engine_api.py EngineAPI), in front of a Cluster.

`create_app(ClusterEngine(cluster), settings)` serves the same SGLang, OpenAI and flowlang
routes as one engine. Requests are validated here, at the front (a bad one gets its 4xx before
it is routed), then routed; the replica streams its chunks back through Ray as they come. If
the replica dies, a request whose chunks nobody has read yet (every non-streamed one) runs
again on another replica; a stream that already sent some ends with a 503 error frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import Future
from typing import Any

from runtime.cache.chunks import TierView
from runtime.cache.view import CacheView, merge_views
from runtime.cluster.cluster import Cluster
from runtime.config import EngineConfig
from runtime.engine_api import EngineCommon
from runtime.errors import EngineBusyError, EngineClosedError, InvalidRequestError
from runtime.handles import RequestHandle
from runtime.intake import RequestIntake
from runtime.model.arch import ModelArch
from runtime.model.registry import resolve_model
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest, ScoreResult, StreamChunk
from runtime.results import error_result
from runtime.scoring import Cancellation
from runtime.summary import EngineSummary

RETRACT_TIMEOUT_S = 30.0  # for the event loop to take back a handle's chunks (it never blocks)


class ClusterEngine(EngineCommon):
    """The engine's surface (EngineAPI), served by a Cluster's replicas: what the server
    serves with `--replicas N`."""

    config: EngineConfig
    arch: ModelArch  # the replicas' (one config: the same model)
    tokenizer: Any  # loaded here too: requests are validated at the front

    def __init__(self, cluster: Cluster, owns_cluster: bool = True) -> None:
        self.cluster = cluster
        self.owns_cluster = owns_cluster  # close() stops the replicas
        self.config = cluster.engine_config
        first = cluster.router.replica_ids[0]
        self.arch, num_slots = cluster.describe(first)
        self.tokenizer = _load_tokenizer(self.config.model)
        self.intake = RequestIntake(self.config, self.arch, self.tokenizer, num_slots)
        self._closed = False

    # ---------------------------------------------------------------- requests
    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Validate, route and run; the handle streams the replica's chunks, then the result."""
        self._check_open()
        req = self.intake.generate_req(request)  # InvalidRequestError: the client's 4xx
        if request.input_ids is None:  # route (and run) on the ids validated here
            request = request.model_copy(update={"input_ids": list(req.prompt_ids), "text": None})
        handle = RequestHandle(request.rid, self.abort, loop)
        streamed = [0]

        def on_chunk(chunk: StreamChunk) -> None:
            streamed[0] += 1
            handle.push_chunk(chunk)

        def retract() -> bool:  # the replica died: run it again if nobody read a chunk
            if not handle.retract(RETRACT_TIMEOUT_S):
                return False
            streamed[0] = 0
            return True

        future = self.cluster.submit(request, on_chunk=on_chunk, retract=retract)
        future.add_done_callback(lambda done: _deliver(handle, request.rid, done, streamed[0]))
        return handle

    def pin(self, prefix: Any, namespace: str | None = None, hints: GraphHints | None = None):
        """Pin a prefix on one replica; its readers are routed there."""
        self._check_open()
        return self.cluster.pin(self.intake.tokens(prefix, special=True), namespace, hints)

    def abort(self, rid: str) -> None:
        """Abort a request on the replica running it."""
        self.cluster.abort(rid)

    def flush_cache(self) -> int:
        """Evict every unlocked cached token on every replica."""
        return self.cluster.flush_caches()

    # ---------------------------------------------------------------- state
    def stats(self) -> dict[str, float]:
        """Every replica's counters summed, and how many replicas are live."""
        per_replica = self.cluster.stats()
        total: dict[str, float] = {"replicas_live": len(per_replica)}
        for stats in per_replica.values():
            for key, value in stats.items():
                if isinstance(value, int | float) and not key.endswith("_rate"):
                    total[key] = total.get(key, 0) + value
        cached, computed = total.get("cached_tokens_total", 0), total.get("prefill_tokens_total", 0)
        total["cache_hit_rate"] = cached / (cached + computed) if cached + computed else 0.0
        return total

    def summary(self) -> EngineSummary:
        """The first live replica's startup summary, with the number of replicas."""
        live = self.cluster.router.replica_ids
        return dataclasses.replace(self.cluster.summary(live[0]), num_replicas=len(live))

    def cache_view(self, max_nodes: int = 40) -> CacheView:
        """Every live replica's radix tree in one view (`max_nodes` shared among them), each
        namespace tagged with its replica."""
        share = max(4, max_nodes // max(1, len(self.cluster.router.replica_ids)))
        return merge_views(self.cluster.cache_views(share))

    def subscribe_kv_events(
        self, max_pending_events: int = 100_000, replica: int | None = None
    ) -> Any:
        """One replica's KV event stream, read through Ray (each replica numbers its own
        events, so there is no merged stream: a follower subscribes to each replica)."""
        live = self.cluster.router.replica_ids
        if replica is None or replica not in live:
            raise InvalidRequestError(
                f"KV events are per replica: name one of the live replicas {live} "
                f"(?replica=N){'' if replica is None else f'; {replica} is not live'}"
            )
        return self.cluster.open_event_reader(replica, max_pending_events)

    def tier_view(self) -> TierView | None:
        """The replicas' lower KV tiers, as the router prices them (one config: all alike)."""
        return self.cluster.router.lower_tiers

    def check_integrity(self) -> None:
        """Assert every live replica's engine invariants."""
        self.cluster.check_integrity()

    @property
    def is_alive(self) -> bool:
        """Whether any replica is routed to, and Ray's control store answers."""
        cluster = self.cluster
        return (
            not self._closed and cluster.control_lost is None and bool(cluster.router.replica_ids)
        )

    @property
    def fatal_error(self) -> str | None:
        """Why the front cannot serve, if it cannot."""
        if self.is_alive or self._closed:
            return None
        return self.cluster.control_lost or "no live replica"

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop the cluster's replicas (after up to `drain_timeout` seconds of draining)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + drain_timeout
        while sum(self.cluster.router.loads().values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.owns_cluster:
            self.cluster.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the cluster front is closed")

    def _score_one(self, request: ScoreRequest, cancel: Cancellation | None) -> ScoreResult:
        """Score on the replica caching most of the prefix; `cancel` reaches it there."""
        prefix_ids = self.intake.tokens(request.prefix, special=True)
        routed = request.model_copy(update={"prefix": prefix_ids})
        return self.cluster.score(routed, cancel=cancel)


def _deliver(handle: RequestHandle, rid: str, done: Future, num_streamed: int) -> None:
    """End a routed request's stream with its result; if nothing was streamed (an error
    before the first token), the result's text goes as one chunk first."""
    try:
        result = done.result()
    except Exception as err:  # noqa: BLE001 - the client gets it as its request's error
        result = error_result(rid, f"the cluster could not run the request: {err}")
        result = result.model_copy(update={"error_kind": _kind_of(err)})
    if num_streamed:
        handle.deliver(result)
        return
    chunk = StreamChunk(
        text=result.text,
        output_ids=list(result.output_ids),
        num_output_tokens=result.completion_tokens,
        num_prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        logprobs=list(result.logprobs or []),
    )
    try:
        handle.push_chunk(chunk)
    finally:
        handle.deliver(result)


def _kind_of(err: Exception) -> str:
    """The error kind (and so the HTTP status) of an error the cluster raised: its own for a
    refused or a busy request, else internal (never a client error for the cluster's fault)."""
    if isinstance(err, InvalidRequestError):
        return "invalid"
    if isinstance(err, EngineBusyError):
        return "busy"
    return "internal"


def _load_tokenizer(model: str) -> Any:
    """The model's tokenizer in the front process (None for random-weight models)."""
    if model.startswith("random:"):
        return None
    from runtime.model.loader import load_tokenizer

    return load_tokenizer(resolve_model(model))
