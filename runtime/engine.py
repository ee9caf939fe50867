"""Engine: the conductor. A loop thread steps schedule -> forward -> process; callers talk to it
through commands.

Any number of Python threads may call `submit`, `generate`, `score`, `pin` concurrently: calls
become commands on a queue that the loop thread drains between steps, so the scheduler, the
radix tree and the KV pool are only ever touched by that one thread.

>>> engine = Engine(EngineConfig(model="smollm2-135m-instruct"))  # doctest: +SKIP
>>> engine.generate([GenerateRequest(text="Hi")])[0].text  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import atexit
import io
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from runtime.cache.chunks import TierView
from runtime.cache.events import KVEventPublisher, KVEventSubscription
from runtime.cache.view import CacheView, PinnedAt, build_cache_view
from runtime.config import EngineConfig
from runtime.engine_api import EngineCommon
from runtime.engine_build import load_model, loop_cpu_share, make_tiers
from runtime.errors import EngineClosedError, InvalidRequestError
from runtime.handles import PinHandle, RequestHandle
from runtime.in_flight import InFlight, unheld_pin
from runtime.intake import RequestIntake
from runtime.loop import EngineLoop, log_failure
from runtime.model.arch import ModelArch
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest, ScoreResult
from runtime.scheduler.entries import ScheduledBatch, batch_of
from runtime.scheduler.scheduler import Scheduler
from runtime.scoring import Cancellation, ContinuationScorer
from runtime.summary import EngineSummary
from runtime.telemetry import score_attributes, tracer
from runtime.verify import apply_logits

T = TypeVar("T")


class Engine(EngineCommon):
    """The flowlang LLM engine (in-process); implements runtime.engine_api.EngineAPI."""

    config: EngineConfig
    arch: ModelArch
    tokenizer: Any  # None: random weights

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        base = config or EngineConfig()
        self.config = EngineConfig(**{**base.model_dump(), **overrides}) if overrides else base
        model = load_model(self.config)
        self.arch, self.runner, self.tokenizer = model.arch, model.runner, model.tokenizer
        self.model_path = model.path
        self.tiers = make_tiers(self.config, self.runner.pool, self.model_path)
        num_slots = self.runner.pool.num_slots
        self.scheduler = Scheduler(self.config, num_slots, self.tiers)
        self.intake = RequestIntake(self.config, self.arch, self.tokenizer, num_slots)
        self._closed = False
        flight = InFlight(self.intake, self.scheduler, self._run_in_loop, lambda: self._closed)
        self._in_flight = flight
        self.scorer = ContinuationScorer(
            self.intake,
            flight.pin_ids,
            flight.abort,
            flight.run_to_end,
            share_prefixes=self.caches_prefixes,
        )
        # KV events: the tree's publisher listens from the start (costs nothing until someone
        # subscribes); the tiers below the pool publish through it too
        self._kv_events: KVEventPublisher = self.scheduler.kv.kv_events
        self.tiers.event_sink = self._kv_events.emit
        self.cpu_share = loop_cpu_share(self.config, self.runner)
        self._jump_forward = self.config.enable_jump_forward
        # the loop thread owns scheduler, tree and pool from here on
        self._loop = EngineLoop(self.step, self.scheduler.has_work, self.scheduler.fail_running)
        _LIVE_ENGINES.add(self)

    # ------------------------------------------------------------------ the step
    def step(self) -> bool:
        """One step: schedule -> forward -> sample/verify -> process. False when nothing
        could run."""
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        if self.cpu_share is not None:
            self.cpu_share.update()  # the cores other processes leave free, read once a second
        start = time.perf_counter()
        try:
            logits = None if batch.forward is None else self.runner.forward(batch.forward)
        except Exception:  # noqa: BLE001 - find the request that breaks it, fail only that one
            log_failure("a forward pass failed; retrying its requests one by one")
            self._run_one_by_one(batch)
            return True
        outcomes = apply_logits(batch, logits, self._jump_forward)
        self.scheduler.observe_step(batch, time.perf_counter() - start)
        self.scheduler.process(batch, outcomes)
        return True

    def _run_one_by_one(self, batch: ScheduledBatch) -> None:
        """After a failed forward: each request's part alone; those that fail again fail."""
        for entry in batch.entries:
            single = batch_of([entry], batch.max_forced_tokens)
            try:
                logits = None if single.forward is None else self.runner.forward(single.forward)
            except Exception as err:  # noqa: BLE001 - this request's own failure
                message = f"the forward pass failed on this request: {err}"
                self.scheduler.fail(entry.req, message, kind="internal")
                continue
            self.scheduler.process(single, apply_logits(single, logits, self._jump_forward))

    @property
    def is_alive(self) -> bool:
        """Whether the loop thread runs (False after close, or if it died)."""
        return self._loop.is_alive

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._closed

    @property
    def fatal_error(self) -> str | None:
        """Why the loop thread died, if it did."""
        return self._loop.fatal_error

    # ------------------------------------------------------------------ public API
    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Queue a request; returns at once. Invalid requests raise InvalidRequestError.
        With `loop`, the handle streams to `astream()` on that event loop."""
        self._check_open()
        flight = self._in_flight  # under the request's span (runtime/telemetry.py; off: none)
        return tracer().traced_submit(
            request, self.config.model, lambda: flight.submit(request, loop)
        )

    def submit_many(self, requests: Sequence[GenerateRequest]) -> list[RequestHandle]:
        """Queue requests that arrive together: no step runs between two of them, so the
        scheduler sees one arrival (deterministic admission order, e.g. for benchmarks)."""
        gate = threading.Event()
        self._run_in_loop(gate.wait)  # the loop waits here until every request is queued
        try:
            return [self.submit(request) for request in requests]
        finally:
            gate.set()

    def pin(
        self, prefix: str | list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinHandle:
        """Prefill `prefix` if it is not cached (once) and lock it until released. Without a
        prefix cache nothing could read it, so nothing is computed or held (`info.held` is
        False) and releasing is a no-op: prefilling it would only add to what requests send."""
        self._check_open()
        ids = self.intake.tokens(prefix, special=True)
        if not self.caches_prefixes:
            self.intake.validate_prompt(ids, 0)  # the errors a held pin would raise
            return unheld_pin(ids, namespace)
        return self._in_flight.pin(ids, namespace, hints)

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request (its result says finish_reason "abort")."""
        self._in_flight.abort(rid)

    def flush_cache(self) -> int:
        """Evict every unlocked cached token now; returns how many were evicted."""
        return self._call_in_loop(self.scheduler.kv.flush)

    # ------------------------------------------------------------------ state
    def stats(self) -> dict[str, float]:
        """Engine counters and gauges (Prometheus-style names)."""

        def collect() -> dict[str, float]:
            return {
                **self.scheduler.stats(),
                "forward_passes_total": self.runner.num_forward_passes,
                "cuda_graph_replays_total": self.runner.num_graph_replays,
                "attention_backend": self.runner.attention.name,
                **({} if self.cpu_share is None else {"cpu_threads": self.cpu_share.threads}),
            }

        return self._call_in_loop(collect)

    def summary(self) -> EngineSummary:
        """What this engine is: model, family, device, dtype, KV pool, kernels (startup lines)."""
        runner = self.runner
        return EngineSummary.of(
            self.config, self.arch, runner.pool, runner.attention.name, self.model_path,
            None if self.cpu_share is None else self.cpu_share.max_threads,
            self.tiers.describe(), runner.model.block_formats(),
        )  # fmt: skip

    def describe_cache(
        self, max_depth: int = 3, max_children: int = 4, max_tokens: int = 12
    ) -> str:
        """The radix tree as text (first tokens of each edge decoded), cut to a summary."""
        cache, render = self.scheduler.kv.cache, _decoder(self.tokenizer)
        return self._call_in_loop(
            lambda: cache.pretty_print(
                io.StringIO(),
                max_tokens=max_tokens,
                max_depth=max_depth,
                max_children=max_children,
                render=render,
            )
        )

    def cache_view(self, max_nodes: int = 40) -> CacheView:
        """The radix tree as a picture: Jupyter draws it; `.to_svg()`, `.to_dict()`."""
        kv, pins, render = self.scheduler.kv, self.scheduler.pins, _decoder(self.tokenizer)
        below = self.tiers.stats

        def view() -> CacheView:
            held = {pid: PinnedAt(p.kv.lock_pos, p.namespace) for pid, p in pins.items()}
            return build_cache_view(kv.cache, held, render, max_nodes, below=below())

        return self._call_in_loop(view)

    def subscribe_kv_events(
        self, max_pending_events: int = 100_000, replica: int | None = None
    ) -> KVEventSubscription:
        """Stream the radix tree's changes (runtime/cache/events.py): a snapshot, then every
        stored/removed/cleared event in order. A reader more than `max_pending_events` behind
        gets KVEventsLostError and must subscribe again. `replica`: None or 0 (one engine is
        replica 0 of a front's API)."""
        if replica not in (None, 0):
            raise InvalidRequestError(
                f"this server is one engine (replica 0), not a front; got {replica}"
            )

        def subscribe() -> KVEventSubscription:
            paths, lower = self.scheduler.kv.cache.edge_paths(), self.tiers.lower_snapshot()
            return self._kv_events.subscribe(paths, max_pending_events, lower)

        return self._call_in_loop(subscribe)

    def tier_view(self) -> TierView | None:
        """How the lower KV tiers name chunks and where their disk is; None without a disk."""
        return self.tiers.view()

    def check_integrity(self) -> None:
        """Assert tree, allocator and scheduler invariants (between steps)."""
        self._call_in_loop(self.scheduler.check_integrity)

    def call_in_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the loop thread between steps and return its result: the only thread
        that may touch the scheduler (runtime/engine_tools.py's hooks use it)."""
        return self._call_in_loop(fn)

    # ------------------------------------------------------------------ lifetime
    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `drain_timeout` seconds,
        abort the rest, release every slot and pin, and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + drain_timeout
        while self.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._loop.stop(self._abort_everything)
        self._kv_events.close_all()
        self.scheduler.kv.persist()  # the loop is gone: its tree and pool are ours to read
        self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _score_one(self, request: ScoreRequest, cancel: Cancellation | None) -> ScoreResult:
        with tracer().start_span(
            "flowlang.score", None, score_attributes(request, self.config.model)
        ):
            return self.scorer.score(request, cancel)

    def _run_in_loop(self, fn: Callable[[], Any]) -> None:
        self._check_open()
        self._loop.post(fn)

    def _call_in_loop(self, fn: Callable[[], Any]) -> Any:
        self._check_open()
        return self._loop.call(fn)

    def _abort_everything(self) -> None:
        scheduler = self.scheduler
        for rid in [*scheduler.waiting, *(r.rid for r in scheduler.running), *scheduler.pins]:
            scheduler.abort(rid)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")


# engines a script never closed, closed at exit: a loop thread still inside torch when the
# interpreter stops daemon threads is cut off in C++ code, and the process aborts (SIGABRT,
# "terminate called without an active exception"). atexit runs before that, and this hook,
# registered after torch's import (engine_build's), before torch's own.
_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _close_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the next engine is closed all the same
            log_failure("closing an engine at exit")


atexit.register(_close_live_engines)


def _decoder(tokenizer: Any) -> Callable[[tuple[int, ...]], str] | None:
    return (lambda ids: tokenizer.decode(list(ids))) if tokenizer is not None else None
