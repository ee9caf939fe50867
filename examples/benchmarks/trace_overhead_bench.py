"""What traces cost (issue 54): W1 through run_batch with OpenTelemetry off and on, interleaved
in one process, medians.

    python examples/benchmarks/trace_overhead_bench.py --users 16 --turns 3 --reps 5

On: an SDK TracerProvider with a BatchSpanProcessor into an in-memory exporter (what a
process pays to make and hand off its spans; an OTLP exporter adds its own thread's network
work), installed with runtime.telemetry.use_tracer_provider. Off: the null tracer (the default
without OTEL_* variables). Each rep runs the same W1 batch once each way on one engine, the
cache flushed before every run, so both ways compute the same prefill; the order alternates.
"""

from __future__ import annotations

import argparse
import statistics
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from flowlang.backends.local import LocalBackend
from programs import support_agent
from runtime import telemetry
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.registry import DEFAULT_MODEL


def timed_run(engine: Engine, batch: list[dict]) -> float:
    engine.flush_cache()
    backend = LocalBackend(engine)
    began = time.perf_counter()
    states = support_agent.support_agent.run_batch(batch, backend=backend, progress=False)
    wall_s = time.perf_counter() - began
    assert all(isinstance(s, support_agent.support_agent.state_type) for s in states)
    return wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_kv_tokens=60_000))
    inputs = support_agent.make_inputs(
        engine.tokenizer, "bench", users=args.users, turns=args.turns
    )
    batch = support_agent.batch_args(inputs)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    walls: dict[str, list[float]] = {"off": [], "on": []}
    timed_run(engine, batch)  # warm-up: kernels, allocator
    for rep in range(args.reps):
        for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            telemetry.use_tracer_provider(provider if mode == "on" else None)
            walls[mode].append(timed_run(engine, batch))
    telemetry.use_tracer_provider(None)
    provider.force_flush()
    spans = len(exporter.get_finished_spans()) // args.reps
    engine.close()
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    print(
        f"\nW1, {args.users} users x {args.turns} turns, {args.model} {args.dtype}, "
        f"{args.reps} reps interleaved, medians\n"
    )
    print("| traces | wall s (median) | all runs | spans a run |")
    print("| --- | ---: | --- | ---: |")
    print(f"| off | {off:.2f} | {', '.join(f'{w:.2f}' for w in walls['off'])} | 0 |")
    print(f"| on | {on:.2f} | {', '.join(f'{w:.2f}' for w in walls['on'])} | {spans} |")
    print(f"\non / off: {on / off:.3f}")


if __name__ == "__main__":
    main()
