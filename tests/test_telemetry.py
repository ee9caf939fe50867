"""Traces (OpenTelemetry): a program's spans, the engine's request spans under them, one trace
across RemoteBackend -> server, a replica joining its caller's trace, and tracing off by
default (runtime/telemetry.py, flowlang/telemetry.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from flowlang import gen, program, select, tool  # noqa: E402
from flowlang.backends.local import LocalBackend  # noqa: E402
from flowlang.backends.remote import RemoteBackend  # noqa: E402
from runtime import telemetry, telemetry_env  # noqa: E402
from runtime.protocol import GenerateRequest, SamplingParams  # noqa: E402

PREFIX = "You are a careful assistant. Answer briefly and name the colour of the sky. " * 3


@pytest.fixture
def spans():
    """Every span ended while the test runs, kept in memory (then tracing is off again)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        telemetry.use_tracer_provider(None)


@program
def fan_out(s):
    s += PREFIX + "Colour:"
    s += select("colour", choices=[" blue", " grey"])
    s += gen("why", max_new_tokens=4, temperature=0)
    branches = s.fork(2)
    for i, branch in enumerate(branches):
        branch += f" Fruit {i}:"
        branch += gen("fruit", max_new_tokens=3, temperature=0)
    s.join(branches)


def by_name(finished, prefix: str) -> list:
    return [s for s in finished if s.name.startswith(prefix)]


def children(finished, parent) -> list:
    return [
        s for s in finished if s.parent is not None and s.parent.span_id == parent.context.span_id
    ]


def test_program_span_tree_and_attributes(served, spans):
    backend = LocalBackend(served.engine, record=True)
    fan_out.run(backend=backend)
    finished = spans.get_finished_spans()
    (run,) = by_name(finished, "flowlang.program fan_out")
    assert run.parent is None
    assert {s.context.trace_id for s in finished} == {run.context.trace_id}  # one trace
    steps = {s.name for s in children(finished, run)}
    assert {"flowlang.select colour", "flowlang.gen why"} <= steps
    assert {"flowlang.branch 0.0", "flowlang.branch 0.1"} <= steps
    (join,) = by_name(finished, "flowlang.join")
    assert join.parent.span_id == run.context.span_id
    assert join.attributes["flowlang.fork.id"].startswith(run.attributes["flowlang.program.id"])
    for branch in by_name(finished, "flowlang.branch "):
        (step,) = children(finished, branch)  # the branch's gen nests under it, not the run
        assert step.name == "flowlang.gen fruit"
        assert branch.attributes["flowlang.fork.num_branches"] == 2
    (select_step,) = by_name(finished, "flowlang.select colour")
    assert [s.name for s in children(finished, select_step)] == ["flowlang.score"]
    assert select_step.attributes["flowlang.select.num_choices"] == 2

    # each gen's engine request span is its step's child and reports the result's counts
    results = {h.result().rid: h.result() for _, h in backend.generations}
    engine_spans = by_name(finished, "text_completion ")
    assert len(engine_spans) == len(results) == 3
    for span in engine_spans:
        result = results[span.attributes["gen_ai.response.id"]]
        parent = next(s for s in finished if s.context.span_id == span.parent.span_id)
        assert parent.name.startswith("flowlang.gen ")
        attributes = span.attributes
        assert attributes["gen_ai.usage.input_tokens"] == result.prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"] == result.completion_tokens
        assert attributes["gen_ai.usage.cache_read.input_tokens"] == result.cached_tokens
        assert attributes["flowlang.prefill.computed_tokens"] == (
            result.prompt_tokens - result.cached_tokens
        )
        assert list(attributes["gen_ai.response.finish_reasons"]) == [result.finish_reason]
        assert attributes["gen_ai.request.max_tokens"] in (3, 4)
        assert attributes["flowlang.queue_wait_s"] >= 0
        assert attributes["flowlang.program.id"] == run.attributes["flowlang.program.id"]
        assert parent.attributes["gen_ai.usage.output_tokens"] == result.completion_tokens
    # the branches extend a prefix the run computed (and pinned) already
    fruit_requests = [s for s in engine_spans if s.attributes["flowlang.branch.id"] != "0"]
    assert len(fruit_requests) == 2
    assert all(s.attributes["gen_ai.usage.cache_read.input_tokens"] > 0 for s in fruit_requests)


def test_tool_calls_and_a_failure_are_spans(served, spans):
    def double(x: int) -> int:
        """Twice x."""
        return 2 * x

    def broken(x: int) -> int:
        """Always fails."""
        raise ValueError("no")

    calls = [tool(double).call({"x": 2}, "call_0"), tool(broken).call({"x": 1}, "call_1")]

    @program
    def uses_tools(s):
        s += "Tools:"
        s.run_tools(calls)

    uses_tools.run(backend=LocalBackend(served.engine))
    finished = spans.get_finished_spans()
    (run,) = by_name(finished, "flowlang.program uses_tools")
    tools = {s.name: s for s in children(finished, run)}
    assert set(tools) == {"execute_tool double", "execute_tool broken"}
    assert tools["execute_tool double"].status.is_ok
    assert not tools["execute_tool broken"].status.is_ok
    assert tools["execute_tool broken"].attributes["gen_ai.tool.call.id"] == "call_1"


def test_one_trace_across_remote_backend_and_server(served, spans):
    backend = RemoteBackend(served.url)
    try:
        fan_out.run(backend=backend)
    finally:
        backend.close()
    finished = spans.get_finished_spans()
    (run,) = by_name(finished, "flowlang.program fan_out")
    engine_spans = by_name(finished, "text_completion ")
    assert len(engine_spans) == 3  # the server's, in this process: traceparent carried them
    strays = [(s.name, s.parent) for s in finished if s.context.trace_id != run.context.trace_id]
    assert not strays
    gen_steps = {s.context.span_id for s in by_name(finished, "flowlang.gen ")}
    assert {s.parent.span_id for s in engine_spans} <= gen_steps
    (score,) = by_name(finished, "flowlang.score")
    (select_step,) = by_name(finished, "flowlang.select colour")
    assert score.parent.span_id == select_step.context.span_id


def test_openai_route_honours_traceparent(served, spans):
    import httpx

    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
    body = {"model": served.engine.config.model, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{served.url}/v1/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    (span,) = by_name(spans.get_finished_spans(), "text_completion ")
    assert f"{span.context.trace_id:032x}" == trace_id
    assert f"{span.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert span.attributes["gen_ai.usage.output_tokens"] == 2


def test_cached_tokens_on_a_second_request_sharing_a_prefix(served, spans):
    engine = served.engine
    ids = engine.tokens(PREFIX * 2, True)
    sampling = SamplingParams(max_new_tokens=2, temperature=0)
    for suffix in ([11, 12], [13, 14]):
        engine.generate([GenerateRequest(input_ids=ids + suffix, sampling=sampling)])
    first, second = by_name(spans.get_finished_spans(), "text_completion ")[-2:]
    assert second.attributes["gen_ai.usage.cache_read.input_tokens"] > 0
    assert second.attributes["flowlang.prefill.computed_tokens"] < len(ids)
    assert second.kind.name == "SERVER"


def test_a_replica_joins_the_trace_its_carrier_names(tiny_model_dir, spans):
    from runtime.cluster.replica import Replica

    replica = Replica({"model": str(tiny_model_dir), "max_kv_tokens": 4096})
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    carrier = {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    request = GenerateRequest(text="Hi", sampling=SamplingParams(max_new_tokens=2))
    try:
        replica.generate(request, carrier)
        list(replica.generate_stream(request.model_copy(update={"rid": "second"}), carrier))
    finally:
        replica.stop(0.0)
    engine_spans = by_name(spans.get_finished_spans(), "text_completion ")
    assert len(engine_spans) == 2
    assert {f"{s.context.trace_id:032x}" for s in engine_spans} == {trace_id}


def test_off_by_default_is_the_null_object(served, monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", *telemetry_env.OTLP_ENDPOINT_VARS):
        monkeypatch.delenv(name, raising=False)
    telemetry.use_tracer_provider(None)
    assert telemetry.tracer() is telemetry.NULL_TRACER
    state = fan_out.run(backend=LocalBackend(served.engine))
    assert state["colour"] in (" blue", " grey")
    assert telemetry.tracer().carrier() == {}


def test_the_environment_decides():
    wanted = telemetry.tracing_wanted
    assert not wanted({})
    assert wanted({"OTEL_TRACES_EXPORTER": "otlp"})
    assert wanted({"OTEL_TRACES_EXPORTER": "console,none"})
    assert not wanted({"OTEL_TRACES_EXPORTER": "none"})
    assert not wanted({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert wanted({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"})
    assert not wanted({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"})
    assert not wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "TRUE"})


ENV_DECIDES = """
import sys
from runtime import telemetry
active = telemetry.tracer()
print(type(active).__name__, "opentelemetry" in sys.modules)
"""

NO_SDK = """
import sys
sys.modules["opentelemetry.sdk"] = None  # as if flowlang[otel] were not installed
from runtime import telemetry
try:
    telemetry.tracer()
except telemetry.TelemetryUnavailableError as err:
    print("error:", err)
"""


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_environment_turns_tracing_on_and_off_in_a_fresh_process():
    assert _run(ENV_DECIDES) == "NullTracer False"  # off: opentelemetry never imported
    assert _run(ENV_DECIDES, OTEL_TRACES_EXPORTER="console") == "OtelTracer True"
    off = _run(ENV_DECIDES, OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert off == "NullTracer False"
    message = _run(NO_SDK, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:4318")
    assert message.startswith("error:") and 'pip install "flowlang[otel]"' in message
