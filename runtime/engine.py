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
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from runtime.cache.chunks import TierLayout
from runtime.cache.events import KVEventPublisher, KVEventSubscription
from runtime.cache.tiers import KVTiers
from runtime.cache.view import CacheView, build_cache_view
from runtime.config import EngineConfig
from runtime.constrain.formats import model_reasoning_format, model_tool_format
from runtime.cpu_share import CpuShare
from runtime.errors import EngineClosedError, InvalidRequestError, error_for_kind
from runtime.handles import PinHandle, RequestHandle
from runtime.intake import RequestIntake
from runtime.loop import EngineLoop, log_failure
from runtime.model.arch import ModelArch
from runtime.model.loader import checkpoint_digest, load_checkpoint, load_tokenizer
from runtime.model.native.kernels import release_openmp_workers
from runtime.model.native.kernels import start_building as start_building_kernels
from runtime.model.registry import check_model_name, resolve_model
from runtime.model.runner import ModelRunner
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    PinInfo,
    ScoreRequest,
    ScoreResult,
)
from runtime.results import error_result, result_of, stream_chunk_of
from runtime.scheduler.request import Req
from runtime.scheduler.scheduler import ScheduledBatch, Scheduler
from runtime.scoring import ContinuationScorer
from runtime.summary import EngineSummary
from runtime.verify import apply_logits


class Engine:
    """The flowlang LLM engine (in-process)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        base = config or EngineConfig()
        self.config = EngineConfig(**{**base.model_dump(), **overrides}) if overrides else base
        self._init_model()
        self._init_scheduler()
        self._init_loop()

    def _init_model(self) -> None:
        """Weights, architecture, tokenizer, and the runner with its KV pool."""
        config = self.config
        if not config.model.startswith("random:"):
            check_model_name(config.model)  # a typo fails here, before any kernel build
        if config.device == "cpu":
            start_building_kernels()  # compiles (first run only) while the model loads
        if config.model.startswith("random:"):
            from runtime.model.random_weights import random_checkpoint

            checkpoint = random_checkpoint(
                config.model, getattr(torch, config.dtype), config.device, config.seed
            )
            self.tokenizer = None
            self.model_path: str | None = None  # random weights
        else:
            path = resolve_model(config.model)
            checkpoint = load_checkpoint(path)
            self.tokenizer = _maybe_tokenizer(path)
            self.model_path = str(path)
        self.arch = ModelArch.from_hf(checkpoint.hf_config)
        num_slots = config.num_kv_slots(self.arch.kv_bytes_per_token(config.dtype))
        self.runner = ModelRunner(self.arch, checkpoint.weights, num_slots, config)

    def _init_scheduler(self) -> None:
        """The scheduler over the pool's slots, request intake and the continuation scorer."""
        num_slots = self.runner.pool.num_slots
        self.tiers = self._make_tiers()
        self.scheduler = Scheduler(self.config, num_slots, self.tiers)
        self.intake = RequestIntake(self.config, self.arch, self.tokenizer, num_slots)
        self.scorer = ContinuationScorer(
            self.intake,
            self._pin_ids,
            self._release_pin,
            self._run_to_end,
            share_prefixes=self.caches_prefixes,
        )
        self._rids: set[str] = set()  # in flight: a request id names one request (abort)
        self._rids_lock = threading.Lock()

    def _make_tiers(self) -> KVTiers | None:
        """L2 (host memory) and L3 (disk) under the pool, when configured."""
        config, pool = self.config, self.runner.pool
        if config.disable_radix_cache or not (config.host_kv_gb or config.disk_kv_dir):
            return None
        layout = TierLayout(
            model=self._weights_identity(),
            num_layers=pool.num_layers,
            num_kv_heads=pool.k[0].shape[1],
            head_dim=pool.k[0].shape[2],
            dtype=pool.dtype,
            page_size=config.page_size,
        )
        return KVTiers(
            pool,
            layout,
            host_bytes=int(config.host_kv_gb * 2**30),
            disk_dir=config.disk_kv_dir,
            disk_bytes=int(config.disk_kv_gb * 2**30),
            write_policy=config.kv_write_policy,
        )

    def _weights_identity(self) -> str:
        """What names these weights for the disk tier: the model as given, plus a digest of
        its weights' bytes and its config (random weights: their seed)."""
        if self.model_path is None:
            return f"{self.config.model}|seed={self.config.seed}"
        return f"{self.config.model}|{checkpoint_digest(self.model_path)}"

    def _init_loop(self) -> None:
        """The loop thread that owns scheduler, tree and pool."""
        self._closed = False
        self._kv_events: KVEventPublisher | None = None  # made by the first subscriber
        cpu = self.runner.device.type == "cpu"
        if cpu:
            # this thread's OpenMP workers (from building the model) would throttle the loop
            # thread's: every parallel region of a step would pay a futex wake-up
            release_openmp_workers()
        adapt = cpu and self.config.adapt_cpu_threads
        self.cpu_share = CpuShare.for_this_process() if adapt else None
        self._jump_forward = self.config.enable_jump_forward
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
            single = self.scheduler.batch_of([entry])
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
        req = self.intake.generate_req(request)
        with self._rids_lock:
            if request.rid in self._rids:
                raise InvalidRequestError(f"request id {request.rid!r} is already in flight")
            self._rids.add(request.rid)
        handle = RequestHandle(request.rid, self.abort, loop)
        req.on_delta = lambda r: handle.push_chunk(stream_chunk_of(r))
        req.on_finish = lambda r: self._finished(handle, r)
        self._run_in_loop(lambda: self.scheduler.add(req))
        return handle

    def submit_many(self, requests: Sequence[GenerateRequest]) -> list[RequestHandle]:
        """Queue requests that arrive together: no step runs between two of them, so the
        scheduler sees one arrival (deterministic admission order, e.g. for benchmarks)."""
        gate = threading.Event()
        self._run_in_loop(gate.wait)  # the loop waits here until every request is queued
        try:
            return [self.submit(request) for request in requests]
        finally:
            gate.set()

    def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest]
    ) -> list[GenerateResult]:
        """Run requests to completion. An invalid one yields a result with finish_reason
        "error" and its message in `error`; the others run normally."""
        if isinstance(requests, GenerateRequest):
            requests = [requests]
        handles: list[RequestHandle | GenerateResult] = []
        for request in requests:
            try:
                handles.append(self.submit(request))
            except InvalidRequestError as err:
                handles.append(error_result(request.rid, str(err)))
        return [h if isinstance(h, GenerateResult) else h.result() for h in handles]

    def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Per-token logprobs of each continuation after its prefix (prefix computed once)."""
        if isinstance(requests, ScoreRequest):
            requests = [requests]
        self._check_open()
        return [self.scorer.score(r) for r in requests]

    @property
    def caches_prefixes(self) -> bool:
        """Whether KV a pin or a finished request computed is reused by later requests (False
        with disable_radix_cache: every request computes its whole prompt)."""
        return not self.config.disable_radix_cache

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
            info = PinInfo(
                pin_id=_new_pin_id(),
                num_tokens=len(ids),
                cached_tokens=0,
                namespace=namespace,
                held=False,
            )
            return PinHandle(info, _release_nothing)
        info, _ = self._pin_ids(ids, namespace, hints, False)
        return PinHandle(info, self._release_pin)

    def unpin(self, handle: PinHandle) -> None:
        handle.release()

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request (its result says finish_reason "abort")."""
        if not self._closed:
            self._run_in_loop(lambda: self.scheduler.abort(rid))

    def flush_cache(self) -> int:
        """Evict every unlocked cached token now; returns how many were evicted."""
        return self._call_in_loop(self.scheduler.kv.flush)

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

    @property
    def tool_format(self) -> str:
        """How this model writes tool calls: configured, or read off the chat template."""
        return model_tool_format(self.config, self.tokenizer)

    @property
    def reasoning_format(self) -> str | None:
        """How this model writes its reasoning, or None."""
        return model_reasoning_format(self.config, self.tokenizer)

    def summary(self) -> EngineSummary:
        """What this engine is: model, family, device, dtype, KV pool, kernels (startup lines)."""
        runner = self.runner
        return EngineSummary.of(
            self.config, self.arch, runner.pool, runner.attention.name, self.model_path,
            None if self.cpu_share is None else self.cpu_share.max_threads,
            None if self.tiers is None else self.tiers.describe(),
        )  # fmt: skip

    def describe_cache(
        self, max_depth: int = 3, max_children: int = 4, max_tokens: int = 12
    ) -> str:
        """The radix tree as text (first tokens of each edge decoded), cut to a summary."""
        cache, render = self.scheduler.kv.cache, _decoder(self.tokenizer)
        return self._call_in_loop(
            lambda: cache.pretty_print(io.StringIO(), max_tokens, max_depth, max_children, render)
        )

    def cache_view(self, max_nodes: int = 40) -> CacheView:
        """The radix tree as a picture: Jupyter draws it; `.to_svg()`, `.to_dict()`."""
        kv, pins, render = self.scheduler.kv, self.scheduler.pins, _decoder(self.tokenizer)
        below = self.tiers.stats if self.tiers is not None else dict
        return self._call_in_loop(
            lambda: build_cache_view(kv.cache, pins, render, max_nodes, below=below())
        )

    def cache_trace(self) -> list[tuple]:
        """The recorded access trace (EngineConfig.record_trace): ("access", namespace, ids,
        match_limit) at each admission and ("insert", namespace, ids) at each tree insert."""
        return self._call_in_loop(lambda: list(self.scheduler.kv.trace or ()))

    def subscribe_kv_events(self, max_pending_events: int = 100_000) -> KVEventSubscription:
        """Stream the radix tree's changes (runtime/cache/events.py): a snapshot, then every
        stored/removed/cleared event in order. A reader more than `max_pending_events` behind
        gets KVEventsLostError and must subscribe again."""

        def subscribe() -> KVEventSubscription:
            cache = self.scheduler.kv.cache
            if self._kv_events is None:
                self._kv_events = KVEventPublisher()
                cache.event_sink = self._kv_events.emit  # a NullCache never calls it
                if self.tiers is not None:
                    self.tiers.event_sink = self._kv_events.emit
            lower = self.tiers.lower_snapshot() if self.tiers is not None else ()
            return self._kv_events.subscribe(cache.edge_paths(), max_pending_events, lower)

        return self._call_in_loop(subscribe)

    def load_eviction_oracle(self, trace: Sequence[tuple]) -> None:
        """Benchmarks only: the "oracle" eviction policy's future, a `cache_trace()` recorded
        by a run of the same work (greedy); call before the first request."""
        if self.config.eviction_policy != "oracle" or self.config.disable_radix_cache:
            raise InvalidRequestError(
                "load_eviction_oracle needs eviction_policy='oracle' and the radix cache on"
            )
        self._call_in_loop(lambda: self.scheduler.kv.marks.load(trace))

    def set_eviction_clock(self, clock: Callable[[], float]) -> None:
        """Benchmarks only: the clock (seconds) that times when paused program branches are
        expected back (`GraphHints.next_turn_after_s`), for runs on a simulated clock."""
        self._call_in_loop(lambda: setattr(self.scheduler.kv, "clock", clock))

    def check_integrity(self) -> None:
        """Assert tree, allocator and scheduler invariants (between steps)."""
        self._call_in_loop(self.scheduler.check_integrity)

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
        if self._kv_events is not None:
            self._kv_events.close_all()
        if self.tiers is not None:  # the loop is gone: its tree and pool are ours to read
            self.scheduler.kv.persist()
            self.tiers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _finished(self, handle: RequestHandle, req: Req) -> None:
        with self._rids_lock:
            self._rids.discard(req.rid)
        try:
            handle.push_chunk(stream_chunk_of(req))
        finally:  # the result is delivered even if the caller's stream broke
            handle.deliver(result_of(req))

    def _pin_ids(
        self, ids: list[int], namespace: str | None, hints: GraphHints | None, keep_row: bool
    ) -> tuple[PinInfo, torch.Tensor | None]:
        """Pin token ids; with `keep_row`, also return the last position's logprob row."""
        pin_id = _new_pin_id()
        req = self.intake.pin_req(pin_id, ids, namespace, hints, keep_row)
        (finished,) = self._run_to_end([req])
        info = PinInfo(
            pin_id=pin_id,
            num_tokens=len(ids),
            cached_tokens=finished.cached_tokens or 0,
            namespace=namespace,
        )
        return info, finished.last_logprobs

    def _release_pin(self, pin_id: str) -> None:
        if not self._closed:
            self._run_in_loop(lambda: self.scheduler.abort(pin_id))

    def _run_to_end(self, reqs: list[Req]) -> list[Req]:
        """Add requests in one command and wait for each to finish (or pin); raise the first
        error."""
        futures: list[Future[Req]] = []
        for req in reqs:
            done: Future[Req] = Future()
            req.on_finish = done.set_result
            futures.append(done)
        self._run_in_loop(lambda: [self.scheduler.add(r) for r in reqs])
        finished = [f.result() for f in futures]
        for req in finished:
            if req.error:
                raise error_for_kind(req.error_kind, req.error)
        return finished

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
# registered after torch's import, before torch's own.
_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _close_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the next engine is closed all the same
            log_failure("closing an engine at exit")


atexit.register(_close_live_engines)


def _new_pin_id() -> str:
    return f"pin-{uuid.uuid4().hex[:12]}"


def _release_nothing(pin_id: str) -> None:
    """An unheld pin's release: the scheduler never saw it."""


def _decoder(tokenizer: Any) -> Callable[[tuple[int, ...]], str] | None:
    return (lambda ids: tokenizer.decode(list(ids))) if tokenizer is not None else None


def _maybe_tokenizer(path) -> Any:
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError):
        return None
