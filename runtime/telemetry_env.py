"""What the standard OTEL_* environment asks of traces, and the SDK tracer provider it sets up
(runtime/telemetry.py decides once from it). opentelemetry is imported only to build that
provider: the optional extra `flowlang[otel]`."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
INSTALL_HINT = 'pip install "flowlang[otel]"'


class TelemetryUnavailableError(RuntimeError):
    """Tracing was asked for (OTEL_* variables) but what it needs is not installed."""


class TelemetryConfigError(ValueError):
    """The OTEL_* variables ask for something flowlang cannot set up."""


def tracing_wanted(env: Mapping[str, str]) -> bool:
    """Whether the OTEL_* variables in `env` ask for traces (OTEL_SDK_DISABLED=true: never)."""
    if disabled(env):
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip():
        return bool(_exporter_names(env))
    return any(env.get(name, "").strip() for name in OTLP_ENDPOINT_VARS)


def disabled(env: Mapping[str, str]) -> bool:
    return env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def global_provider() -> Any:
    """The global tracer provider an application installed, if any: only possible once it
    imported opentelemetry.trace, so nothing is imported to find out."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    unset = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    return None if isinstance(provider, unset) else provider


def _exporter_names(env: Mapping[str, str]) -> list[str]:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    return [n for n in names if n and n != "none"]


def provider_from(env: Mapping[str, str]) -> Any:
    """An SDK TracerProvider exporting as the OTEL_* variables say (batched), made global."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as err:
        raise TelemetryUnavailableError(
            f"the OTEL_* environment asks for traces, and the OpenTelemetry SDK is not "
            f"installed: {INSTALL_HINT} (or set OTEL_SDK_DISABLED=true)"
        ) from err
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(
        resource=Resource.create({} if named else {"service.name": "flowlang"})
    )
    for name in _exporter_names(env) or ["otlp"]:  # an endpoint alone means OTLP
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    trace.set_tracer_provider(provider)  # the application's own spans join the same traces
    return provider


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    """The span exporter OTEL_TRACES_EXPORTER names: otlp (http/protobuf) or console."""
    if name == "console":  # on stderr: a program's stdout stays its own (benchmark tables)
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter(out=sys.stderr)
    if name != "otlp":
        raise TelemetryConfigError(
            f"OTEL_TRACES_EXPORTER={name!r}: flowlang sets up 'otlp', 'console' or 'none'"
        )
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        raise TelemetryConfigError(
            f"OTLP protocol {protocol!r}: flowlang[otel] exports over 'http/protobuf' (set "
            "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, port 4318)"
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as err:
        raise TelemetryUnavailableError(
            f"OTLP traces need the OTLP exporter: {INSTALL_HINT}"
        ) from err
    return OTLPSpanExporter()  # reads the endpoint, headers and timeout variables itself
