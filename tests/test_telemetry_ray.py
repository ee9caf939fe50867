"""Traces across Ray: a request routed to a replica (its own process, tracing on from the OTEL_*
variables it inherits) exports its engine-request span into the trace of the driver's span
that sent it. The replica exports over OTLP/HTTP to a collector this test runs."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
ray = pytest.importorskip("ray")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from runtime import telemetry  # noqa: E402
from runtime.cluster.cluster import Cluster, ClusterConfig  # noqa: E402
from runtime.cluster.ray_support import init_ray  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.protocol import GenerateRequest, SamplingParams  # noqa: E402

WAIT_S = 60.0


class Collector(ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: (trace id, span name) of every span posted."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str]] = []
        super().__init__(("127.0.0.1", 0), _Receive)


class _Receive(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                self.server.spans += [(s.trace_id.hex(), s.name) for s in scope.spans]
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector():
    server = Collector()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_a_replica_span_joins_the_callers_trace(collector, tiny_model_dir):
    if ray.is_initialized():  # another module's cluster: its workers lack the variables
        ray.shutdown()
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.server_port}/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: the replica's batch goes out at once
        "OTEL_SERVICE_NAME": "flowlang-replica",
    }
    os.environ.update(env)  # before Ray starts: its workers inherit them
    provider = TracerProvider()
    telemetry.use_tracer_provider(provider)  # the driver's spans, kept in process
    try:
        init_ray(num_cpus=2)
        config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)
        with Cluster(config, ClusterConfig(num_replicas=1)) as cluster:
            request = GenerateRequest(
                text="The sky is", sampling=SamplingParams(max_new_tokens=3, temperature=0)
            )
            with provider.get_tracer("test").start_as_current_span("caller") as caller:
                (result,) = cluster.generate([request])
            assert result.finish_reason in ("length", "stop")
            trace_id = format(caller.get_span_context().trace_id, "032x")
            deadline = time.monotonic() + WAIT_S
            while not any(
                t == trace_id and n.startswith("text_completion") for t, n in collector.spans
            ):
                assert time.monotonic() < deadline, collector.spans
                time.sleep(0.1)
    finally:
        for name in env:
            os.environ.pop(name, None)
        telemetry.use_tracer_provider(None)
        ray.shutdown()
