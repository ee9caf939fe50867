"""Traces (OpenTelemetry): off unless the standard OTEL_* environment asks for them.

Decided once, at first use, from the environment (`tracing_wanted`): on when
OTEL_TRACES_EXPORTER names an exporter other than `none`, or an OTLP endpoint
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, or the application
already installed a global tracer provider; OTEL_SDK_DISABLED=true turns it off whatever else
says. `use_tracer_provider` installs one explicitly (tests, an app with its own SDK setup).

Off, every call is answered by NULL_TRACER and opentelemetry is never imported (it is the
optional extra `flowlang[otel]`). On without the SDK installed: TelemetryUnavailableError.

Context crosses threads and processes explicitly: a span's `context` is the parent handed to
work on another thread; `carrier()` / `attached(carrier)` carry it as W3C `traceparent`
headers (HTTP, Ray). Torch-free: flowlang imports it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from runtime.telemetry_env import (
    TelemetryConfigError,
    TelemetryUnavailableError,
    disabled,
    global_provider,
    provider_from,
    tracing_wanted,
)

__all__ = ["TelemetryConfigError", "TelemetryUnavailableError", "tracing_wanted"]


class NullSpan:
    """A span when tracing is off: every method does nothing; `with` it, and nothing is
    current. Also the null `attached(...)` context."""

    __slots__ = ()
    context = None  # no parent to hand on

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Nothing is recorded."""

    def record_error(self, err: BaseException) -> None:
        """Nothing is recorded."""

    def end(self) -> None:
        """Nothing to end."""

    def __enter__(self) -> NullSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


NULL_SPAN = NullSpan()


class NullTracer:
    """Tracing off: spans are NULL_SPAN, carriers empty, submits untouched."""

    enabled = False

    def start_span(
        self, name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
        kind: str = "internal",
    ) -> NullSpan:  # fmt: skip
        """NULL_SPAN."""
        return NULL_SPAN

    def current_context(self) -> None:
        """No context to hand on."""
        return None

    def carrier(self) -> dict[str, str]:
        """No headers to add."""
        return {}

    def attached(self, carrier: Mapping[str, str] | None) -> NullSpan:
        """Nothing to attach."""
        return NULL_SPAN

    def traced_submit(self, request: Any, model: str, submit: Callable[[], Any]) -> Any:
        """`submit()` as it is."""
        return submit()


NULL_TRACER = NullTracer()


class OtelSpan:
    """One OpenTelemetry span. `with span:` makes it current on this thread, records an
    exception that leaves the block and ends it; `end()` ends a span started without `with`
    (idempotent: a branch's span may be ended by its join and by the run's close)."""

    __slots__ = ("_span", "_context", "_token", "_lock")

    def __init__(self, span: Any, context: Any) -> None:
        self._span, self._context, self._token = span, context, None
        self._lock = threading.Lock()

    @property
    def context(self) -> Any:
        """The context with this span current: the parent of work it hands to another thread."""
        return self._context

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Set the attributes whose values are known (None is skipped)."""
        self._span.set_attributes(_known(attributes))

    def record_error(self, err: BaseException) -> None:
        """The exception as an event, the span's status ERROR."""
        from opentelemetry.trace import Status, StatusCode

        self._span.record_exception(err)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(err).__name__}: {err}"))

    def end(self) -> None:
        """End it (a second call does nothing)."""
        with self._lock:
            if self._span.is_recording():
                self._span.end()

    def __enter__(self) -> OtelSpan:
        from opentelemetry import context

        self._token = context.attach(self._context)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        from opentelemetry import context

        context.detach(self._token)
        if exc is not None:
            self.record_error(exc)
        self.end()


class _Attached:
    """`with`: an OpenTelemetry context is current on this thread, then the previous one."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: Any) -> None:
        self._context, self._token = context, None

    def __enter__(self) -> _Attached:
        from opentelemetry import context

        self._token = context.attach(self._context)
        return self

    def __exit__(self, *exc: object) -> None:
        from opentelemetry import context

        context.detach(self._token)


class OtelTracer:
    """Tracing on, through an OpenTelemetry tracer provider."""

    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace

        self._tracer = provider.get_tracer("flowlang")
        self._trace = trace

    def start_span(
        self, name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
        kind: str = "internal",
    ) -> OtelSpan:  # fmt: skip
        """A started span, child of `parent` (a context; None: this thread's current one)."""
        span_kind = getattr(self._trace.SpanKind, kind.upper())
        span = self._tracer.start_span(
            name, context=parent, kind=span_kind, attributes=_known(attributes or {})
        )
        return OtelSpan(span, self._trace.set_span_in_context(span, parent))

    def current_context(self) -> Any:
        """This thread's current context (to parent work on other threads)."""
        from opentelemetry import context

        return context.get_current()

    def carrier(self) -> dict[str, str]:
        """The current context as headers (`traceparent`, `tracestate`)."""
        from opentelemetry import propagate

        headers: dict[str, str] = {}
        propagate.inject(headers)
        return headers

    def attached(self, carrier: Mapping[str, str] | None) -> _Attached | NullSpan:
        """`with`: the context `carrier` holds (W3C headers) is current on this thread."""
        if not carrier:
            return NULL_SPAN
        from opentelemetry import propagate

        return _Attached(propagate.extract(carrier))

    def traced_submit(self, request: Any, model: str, submit: Callable[[], Any]) -> Any:
        """`submit()` an engine request under its span (child of the current context), ended
        with the counters of its result (runtime/results.py) when the handle resolves."""
        attributes = request_attributes(request, model)
        span = self.start_span(f"text_completion {model}", None, attributes, kind="server")
        try:
            handle = submit()
        except BaseException as err:
            span.record_error(err)
            span.end()
            raise
        handle.when_delivered(lambda result: _end_request_span(span, result))
        return handle


def request_attributes(request: Any, model: str) -> dict[str, Any]:
    """A GenerateRequest as GenAI attributes (what was asked)."""
    params, hints = request.sampling, request.hints
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "flowlang",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_new_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.top_k": params.top_k or None,
        "gen_ai.request.seed": params.seed,
        "gen_ai.request.stop_sequences": params.stop or None,
        "flowlang.request.id": request.rid,
        "flowlang.program.id": hints.program_id,
        "flowlang.branch.id": hints.branch_id,
    }


def result_attributes(result: Any) -> dict[str, Any]:
    """A GenerateResult as GenAI attributes: tokens computed, cached, loaded, decoded."""
    return {
        "gen_ai.response.id": result.rid,
        "gen_ai.response.finish_reasons": [result.finish_reason or "unknown"],
        "gen_ai.usage.input_tokens": result.prompt_tokens,
        "gen_ai.usage.output_tokens": result.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": result.cached_tokens,
        "flowlang.prefill.computed_tokens": result.prompt_tokens - result.cached_tokens,
        "flowlang.prefill.cached_tokens": result.cached_tokens,
        "flowlang.prefill.loaded_tokens": result.loaded_tokens,
        "flowlang.decode.tokens": result.completion_tokens,
        "flowlang.queue_wait_s": result.queue_wait_s,
        "flowlang.ttft_s": result.ttft_s,
        "error.type": result.error_kind if result.finish_reason == "error" else None,
    }


def score_attributes(request: Any, model: str) -> dict[str, Any]:
    """A ScoreRequest (select's continuations) as attributes."""
    return {
        "gen_ai.request.model": model,
        "flowlang.score.num_continuations": len(request.continuations),
        "flowlang.program.id": request.hints.program_id,
        "flowlang.branch.id": request.hints.branch_id,
    }


def _end_request_span(span: OtelSpan, result: Any) -> None:
    """End an engine request's span with its result (before its caller sees it)."""
    span.set_attributes(result_attributes(result))
    if result.finish_reason == "error":
        span.record_error(RuntimeError(result.error or "the request failed"))
    span.end()


def _known(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


# ---------------------------------------------------------------------- on or off
_active: NullTracer | OtelTracer | None = None  # None: not decided yet
_decide_lock = threading.Lock()


def tracer() -> NullTracer | OtelTracer:
    """The tracer in use: decided from the environment at first use (NULL_TRACER when off)."""
    active = _active
    return active if active is not None else _decide()


def use_tracer_provider(provider: Any) -> None:
    """Trace through `provider` from now on (e.g. a TracerProvider with an InMemorySpanExporter
    in tests); None forgets it, and the environment decides again at the next use."""
    global _active
    with _decide_lock:
        _active = None if provider is None else OtelTracer(provider)


def _decide() -> NullTracer | OtelTracer:
    global _active
    with _decide_lock:
        if _active is None:
            env = os.environ  # the one place the OTEL_* variables are read
            if tracing_wanted(env):
                _active = OtelTracer(global_provider() or provider_from(env))
            else:  # an application that set up its own provider is traced through it
                provider = None if disabled(env) else global_provider()
                _active = NULL_TRACER if provider is None else OtelTracer(provider)
        return _active


class TraceContextMiddleware:
    """ASGI: a request's W3C `traceparent` (and `tracestate`) is the current trace context
    while its route runs, so the engine request spans it submits join the caller's trace
    (every API: flowlang's, OpenAI's, SGLang's)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        tracer()  # decided as the server starts: a missing SDK stops `flowlang serve` at once

    async def __call__(self, scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        carrier = None
        if scope["type"] == "http":
            carrier = {
                key.decode("latin-1"): value.decode("latin-1")
                for key, value in scope["headers"]
                if key in (b"traceparent", b"tracestate")
            }
        with tracer().attached(carrier):
            await self.app(scope, receive, send)
