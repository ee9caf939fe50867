"""Engine: tokenizer + model runner + scheduler, stepping on a background thread.

Any number of Python threads may call `submit`, `generate`, `score`, `pin` concurrently: calls
become commands on a queue that the loop thread drains between steps, so the scheduler, the
radix tree and the KV pool are only ever touched by that one thread.

>>> engine = Engine(EngineConfig(model="smollm2-135m-instruct"))  # doctest: +SKIP
>>> engine.generate([GenerateRequest(text="Hi")])[0].text  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import io
import itertools
import queue
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from runtime.config import EngineConfig
from runtime.generation import GenerationState
from runtime.model.arch import ModelArch
from runtime.model.loader import load_checkpoint, load_tokenizer
from runtime.model.registry import resolve_model
from runtime.model.runner import ModelRunner
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    PinInfo,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TokenLogprob,
)
from runtime.scheduler.request import Req, ReqKind
from runtime.scheduler.scheduler import Scheduler


class InvalidRequestError(ValueError):
    """A request the engine refuses before running it; the message names the problem."""


class EngineClosedError(RuntimeError):
    """The engine was closed; it accepts nothing more."""


class RequestError(RuntimeError):
    """A request that failed while running (the engine itself keeps serving)."""


_DONE = object()


class RequestHandle:
    """A submitted request: `result()` waits for it, iterating yields its text as it streams.

    Made with an event loop (`submit(..., loop=...)`), it streams to `astream()` instead.
    """

    def __init__(
        self, engine: Engine, rid: str, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.rid = rid
        self.future: Future[GenerateResult] = Future()
        self._engine = engine
        self._loop = loop
        self._deltas: queue.Queue = queue.Queue()
        self._adeltas: asyncio.Queue | None = asyncio.Queue() if loop is not None else None

    def result(self, timeout: float | None = None) -> GenerateResult:
        return self.future.result(timeout)

    async def aresult(self) -> GenerateResult:
        return await asyncio.wrap_future(self.future)

    def __iter__(self) -> Iterator[str]:
        """Text deltas as they become final (stop strings are never shown)."""
        if self._adeltas is not None:
            raise RuntimeError("this handle streams to astream() (it was made with a loop)")
        while (delta := self._deltas.get()) is not _DONE:
            yield delta

    async def astream(self):
        """Text deltas, for handles submitted with an event loop."""
        while (delta := await self._adeltas.get()) is not _DONE:
            yield delta

    def cancel(self) -> None:
        self._engine.abort(self.rid)

    def _put(self, item: Any) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._adeltas.put_nowait, item)
        else:
            self._deltas.put(item)


class PinHandle:
    """A pinned prefix: locked in the cache until `release()` (or until this handle is dropped)."""

    def __init__(self, engine: Engine, info: PinInfo) -> None:
        self.info = info
        self.pin_id = info.pin_id
        self._finalizer = weakref.finalize(self, engine._unpin_quietly, info.pin_id)

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> PinHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Engine:
    """The flowlang LLM engine (in-process)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        base = config or EngineConfig()
        self.config = EngineConfig(**{**base.model_dump(), **overrides}) if overrides else base
        if self.config.model.startswith("random:"):
            from runtime.model.random_weights import random_checkpoint

            checkpoint = random_checkpoint(
                self.config.model,
                getattr(torch, self.config.dtype),
                self.config.device,
                self.config.seed,
            )
            self.tokenizer = None
        else:
            path = resolve_model(self.config.model)
            checkpoint = load_checkpoint(path)
            self.tokenizer = _maybe_tokenizer(path)
        self.arch = ModelArch.from_hf(checkpoint.hf_config)
        num_slots = self.config.num_kv_slots(
            self.arch.kv_bytes_per_token(getattr(torch, self.config.dtype))
        )
        self.runner = ModelRunner(
            self.arch,
            checkpoint.weights,
            num_slots,
            self.config.dtype,
            self.config.device,
            self.config.attention_backend,
            self.config.page_size,
        )
        del checkpoint
        self.scheduler = Scheduler(
            self.runner,
            self.config.page_size,
            self.config.schedule_policy,
            self.config.eviction_policy,
            self.config.disable_radix_cache,
            self.config.chunked_prefill_tokens,
            self.config.max_running_requests,
            self.config.seed,
            self.config.record_trace,
            self.config.enable_jump_forward,
        )
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self._grammars = None
        self._grammar_lock = threading.Lock()
        self._rids: set[str] = set()
        self._rids_lock = threading.Lock()
        self._arrivals = itertools.count()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flowlang-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Queue a request; returns at once. Invalid requests raise InvalidRequestError.
        With `loop`, the handle streams to `astream()` on that event loop."""
        self._check_open()
        prompt_ids = self._prompt_ids(request)
        constraint = self._constraint_state(request)
        with self._rids_lock:  # a request id names one request in flight (abort targets it)
            if request.rid in self._rids:
                raise InvalidRequestError(f"request id {request.rid!r} is already in flight")
            self._rids.add(request.rid)
        handle = RequestHandle(self, request.rid, loop)
        req = self._make_req(
            request.rid, prompt_ids, request.sampling, request.namespace, request.hints, handle
        )
        req.gen.constraint = constraint
        if request.sampling.max_new_tokens == 0:
            req.kind = ReqKind.PREFILL
        self._run_in_loop(lambda: self.scheduler.add(req))
        return handle

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
                handles.append(_error_result(request.rid, str(err)))
        return [h if isinstance(h, GenerateResult) else h.result() for h in handles]

    def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Per-token logprobs of each continuation after its prefix (prefix computed once)."""
        if isinstance(requests, ScoreRequest):
            requests = [requests]
        return [self._score_one(r) for r in requests]

    def pin(
        self, prefix: str | list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinHandle:
        """Prefill `prefix` if it is not cached (once) and lock it until released."""
        self._check_open()
        info, _ = self._pin(self._tokens(prefix, special=True), namespace, hints, False)
        return PinHandle(self, info)

    def unpin(self, handle: PinHandle) -> None:
        handle.release()

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request (its result says finish_reason "abort")."""
        if not self._closed:
            self._run_in_loop(lambda: self.scheduler.abort(rid))

    def flush_cache(self) -> int:
        """Evict every unlocked cached token now; returns how many were evicted."""
        return self._call_in_loop(self.scheduler.flush_cache)

    def stats(self) -> dict[str, float]:
        """Engine counters and gauges (Prometheus-style names)."""
        return self._call_in_loop(self._collect_stats)

    def describe_cache(
        self, max_depth: int = 3, max_children: int = 4, max_tokens: int = 12
    ) -> str:
        """The radix tree as text (first tokens of each edge decoded), cut to a summary."""
        cache = self.scheduler.cache
        if cache is None:
            return "(the radix cache is disabled)"
        tokenizer = self.tokenizer
        render = (lambda ids: tokenizer.decode(list(ids))) if tokenizer is not None else None
        return self._call_in_loop(
            lambda: cache.pretty_print(io.StringIO(), max_tokens, max_depth, max_children, render)
        )

    def cache_trace(self) -> list[tuple]:
        """The recorded access trace (EngineConfig.record_trace): ("access", namespace, ids,
        match_limit) at each admission and ("insert", namespace, ids) at each tree insert."""
        return self._call_in_loop(lambda: list(self.scheduler.trace or ()))

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
        self._commands.put(self._abort_everything)
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ requests
    @property
    def grammars(self) -> Any:
        """The grammar cache (xgrammar), made on first use."""
        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError("constrained generation needs a tokenizer")
                from runtime.model.constrained import GrammarCache

                self._grammars = GrammarCache(
                    self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids
                )
            return self._grammars

    def _constraint_state(self, request: GenerateRequest) -> Any:
        """Compile the request's constraint now, so a bad one fails at submit."""
        if request.constraint is None:
            return None
        from runtime.model.constrained import InvalidConstraintError

        try:
            return self.grammars.new_state(request.constraint)
        except InvalidConstraintError as err:
            raise InvalidRequestError(str(err)) from err

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        ids = (
            list(request.input_ids)
            if request.input_ids is not None
            else self._tokens(request.text, special=True)
        )
        self._validate_prompt(ids, request.sampling.max_new_tokens)
        return ids

    def _tokens(self, text_or_ids: str | list[int], special: bool) -> list[int]:
        if not isinstance(text_or_ids, str):
            return list(text_or_ids)
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send input_ids, not text")
        return list(self.tokenizer.encode(text_or_ids, add_special_tokens=special))

    def _validate_prompt(self, ids: list[int], max_new_tokens: int) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary (0..{self.arch.vocab_size - 1})"
            )
        context = self.arch.max_context_len
        if len(ids) + max_new_tokens > context:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"model's context of {context} tokens"
            )
        pool = self.runner.pool.num_slots
        if len(ids) + max_new_tokens > pool:
            raise InvalidRequestError(
                f"prompt of {len(ids)} tokens + max_new_tokens {max_new_tokens} can never fit "
                f"in the KV pool of {pool} slots"
            )

    def _make_req(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str | None,
        hints: GraphHints,
        handle: RequestHandle | None,
        kind: ReqKind = ReqKind.GENERATE,
        **kwargs: Any,
    ) -> Req:
        gen = GenerationState(
            params, prompt_ids, self.tokenizer, self.arch.eos_token_ids, self.arch.vocab_size
        )
        if gen.generator is None:
            gen.generator = self._rng
        logprob_start = (params.logprob_start_len or 1) if params.prompt_logprobs else None
        req = Req(
            rid,
            prompt_ids,
            gen,
            kind,
            namespace,
            hints,
            next(self._arrivals),
            logprob_start=kwargs.pop("logprob_start", logprob_start),
            **kwargs,
        )
        if handle is not None:
            req.on_delta = lambda r: _push_delta(handle, r)
            req.on_finish = lambda r: self._finished(handle, r)
        return req

    def _finished(self, handle: RequestHandle, req: Req) -> None:
        with self._rids_lock:
            self._rids.discard(req.rid)
        _deliver(handle, req, _result(req))

    def _pin(
        self,
        prefix_ids: list[int],
        namespace: str | None,
        hints: GraphHints | None,
        keep_last_logprobs: bool,
    ) -> tuple[PinInfo, torch.Tensor | None]:
        self._validate_prompt(prefix_ids, 0)
        done: Future = Future()
        pin_id = f"pin-{uuid.uuid4().hex[:12]}"
        req = self._make_req(
            pin_id,
            prefix_ids,
            SamplingParams(max_new_tokens=0),
            namespace,
            hints or GraphHints(),
            None,
            ReqKind.PIN,
            keep_last_logprobs=keep_last_logprobs,
        )
        req.on_finish = done.set_result
        self._run_in_loop(lambda: self.scheduler.add(req))
        finished: Req = done.result()
        if finished.error:
            raise RequestError(finished.error)
        info = PinInfo(
            pin_id=pin_id,
            num_tokens=len(prefix_ids),
            cached_tokens=finished.cached_tokens or 0,
            namespace=namespace,
        )
        return info, finished.last_logprobs

    def _unpin_quietly(self, pin_id: str) -> None:
        if not self._closed:
            self._run_in_loop(lambda: self.scheduler.abort(pin_id))

    def _score_one(self, request: ScoreRequest) -> ScoreResult:
        """Score every continuation with each token computed once.

        The continuations form a trie under the prefix. Every trie node whose next-token row
        is needed and that two or more continuations share (the prefix itself first) is
        pinned with its last logprob row kept; each continuation then computes only its own
        unshared tail, with prompt logprobs from where it diverges.
        """
        self._check_open()
        prefix_ids = self._tokens(request.prefix, special=True)
        conts = [self._tokens(c, special=False) for c in request.continuations]
        if any(not c for c in conts):
            raise InvalidRequestError("every continuation needs at least one token")
        self._validate_prompt(prefix_ids, max(map(len, conts)))
        shares: dict[tuple[int, ...], int] = {}
        rows_needed: set[tuple[int, ...]] = set()
        for cont in conts:
            for m in range(len(cont) + 1):
                shares[tuple(cont[:m])] = shares.get(tuple(cont[:m]), 0) + 1
                if m < len(cont):
                    rows_needed.add(tuple(cont[:m]))
        shared_rows = (
            []
            if self.config.disable_radix_cache
            else sorted((n for n in rows_needed if shares[n] >= 2), key=len)
        )
        rows: dict[tuple[int, ...], torch.Tensor] = {}
        pin_ids: list[str] = []
        try:
            for node in shared_rows:  # shortest first: each pin computes one new token
                info, rows[node] = self._pin(
                    prefix_ids + list(node), request.namespace, request.hints, True
                )
                pin_ids.append(info.pin_id)
            reqs: dict[int, Req] = {}
            handles = []
            for i, cont in enumerate(conts):
                diverge = next((m for m in range(len(cont)) if tuple(cont[:m]) not in rows), None)
                if diverge is None:
                    continue  # every row this continuation needs came with a pin
                handle = RequestHandle(self, uuid.uuid4().hex)
                # the last token's KV is never needed: its logprob is the last row's
                reqs[i] = self._make_req(
                    handle.rid,
                    prefix_ids + cont[:-1],
                    SamplingParams(max_new_tokens=0),
                    request.namespace,
                    request.hints,
                    handle,
                    ReqKind.PREFILL,
                    logprob_start=len(prefix_ids) + diverge,
                    keep_last_logprobs=True,
                )
                handles.append(handle)
            if reqs:
                self._run_in_loop(lambda: [self.scheduler.add(r) for r in reqs.values()])
            for handle in handles:
                result = handle.result()
                if result.finish_reason == "error":
                    raise RequestError(result.error)
            token_logprobs = [
                [
                    self._score_token(rows, reqs.get(i), prefix_ids, cont, j)
                    for j in range(len(cont))
                ]
                for i, cont in enumerate(conts)
            ]
        finally:
            for pin_id in pin_ids:
                self._unpin_quietly(pin_id)
        return ScoreResult(
            prefix_ids=prefix_ids, continuation_ids=conts, token_logprobs=token_logprobs
        )

    @staticmethod
    def _score_token(
        rows: dict, req: Req | None, prefix_ids: list[int], cont: list[int], j: int
    ) -> float:
        """Logprob of cont[j]: from a pinned trie node's row, the request's prompt logprobs,
        or (the last token) the request's last row."""
        context = tuple(cont[:j])
        if context in rows:
            return float(rows[context][cont[j]])
        if j == len(cont) - 1:
            return float(req.last_logprobs[cont[j]])
        return float(req.prompt_logprobs[len(prefix_ids) + j])

    # ------------------------------------------------------------------ loop thread
    def _loop(self) -> None:
        scheduler = self.scheduler
        while True:
            busy = scheduler.has_work()
            try:
                command = self._commands.get(block=not busy, timeout=None if not busy else 0)
            except queue.Empty:
                command = None
            while command is not None:
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stop.is_set() and self._commands.empty():
                return
            if scheduler.has_work():
                try:
                    progressed = scheduler.step()
                except Exception:  # noqa: BLE001 - a failed step fails its requests, not the engine
                    message = traceback.format_exc(limit=8)
                    print(f"[flowlang] engine step failed:\n{message}", file=sys.stderr)
                    scheduler.fail_all_running(f"engine step failed: {message.splitlines()[-1]}")
                    progressed = True
                if not progressed:
                    self._stop.wait(0.001)

    def _run_in_loop(self, fn: Callable[[], Any]) -> None:
        self._check_open()
        self._commands.put(fn)

    def _call_in_loop(self, fn: Callable[[], Any]) -> Any:
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)

        self._run_in_loop(run)
        return done.result()

    def _abort_everything(self) -> None:
        scheduler = self.scheduler
        for rid in [*scheduler.waiting, *(r.rid for r in scheduler.running), *scheduler.pins]:
            scheduler.abort(rid)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    def _collect_stats(self) -> dict[str, float]:
        scheduler, cache = self.scheduler, self.scheduler.cache
        c = scheduler.counters
        computed, cached = c["prefill_tokens"], c["cached_tokens"]
        return {
            "prefill_tokens_total": computed,
            "decode_tokens_total": c["decode_tokens"],
            "cached_tokens_total": cached,
            "cache_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "evicted_tokens_total": cache.num_evicted_tokens if cache else 0,
            "retractions_total": c["retractions"],
            "prefill_waits_total": c["prefill_waits"],
            "requests_finished_total": c["finished"],
            "requests_aborted_total": c["aborted"],
            "requests_failed_total": c["errors"],
            "forward_passes_total": self.runner.num_forward_passes,
            "steps_total": c["steps"],
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "num_pins": len(scheduler.pins),
            "kv_slots_total": scheduler.allocator.num_slots,
            "kv_slots_used": scheduler.allocator.num_used_slots,
            "kv_slots_peak": c["peak_used_slots"],
            "cache_tokens": cache.total_size if cache else 0,
            "cache_evictable_tokens": cache.evictable_size if cache else 0,
            "cache_protected_tokens": cache.protected_size if cache else 0,
            "cache_nodes": cache.num_nodes if cache else 0,
            "schedule_rematches_total": scheduler.policy.num_rematches,
            "new_token_ratio": scheduler.new_token_ratio,
            "jump_forward_tokens_total": c["jump_forward_tokens"],
            "attention_backend": self.runner.attention.name,
        }


def _maybe_tokenizer(path) -> Any:
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError):
        return None


def _push_delta(handle: RequestHandle, req: Req) -> None:
    delta = req.gen.stream_delta()
    if delta:
        handle._put(delta)


def _deliver(handle: RequestHandle, req: Req, result: GenerateResult) -> None:
    _push_delta(handle, req)
    handle._put(_DONE)
    handle.future.set_result(result)


def _result(req: Req) -> GenerateResult:
    gen = req.gen
    logprobs = None
    if gen.params.logprobs or gen.params.top_logprobs:
        tops = gen.output_top_logprobs or [None] * len(gen.output_logprobs)
        logprobs = [
            TokenLogprob(token_id=t, logprob=lp, top=top)
            for t, lp, top in zip(gen.output_ids, gen.output_logprobs, tops, strict=False)
        ]
    return GenerateResult(
        rid=req.rid,
        text=gen.text,
        output_ids=list(gen.output_ids),
        finish_reason=gen.finish_reason,
        matched_stop=gen.matched_stop,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens or 0,
        completion_tokens=len(gen.output_ids),
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs if gen.params.prompt_logprobs else None,
        prompt_ids=list(req.prompt_ids) if gen.params.prompt_logprobs else None,
        error=req.error,
    )


def _error_result(rid: str, message: str) -> GenerateResult:
    return GenerateResult(
        rid=rid,
        text="",
        output_ids=[],
        finish_reason="error",
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        error=message,
    )
