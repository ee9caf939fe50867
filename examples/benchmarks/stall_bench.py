"""Event-loop stall: the worst /health latency while heavy requests are in flight.

    python examples/benchmarks/stall_bench.py [--window-s 20]

A server on the default model; a probe asks /health every 50 ms while (1) an 8 MB prompt,
(2) a 1 MB regex constraint and (3) a 20 kB regex of many grammar states (60 MiB compiled) are
posted. Work done on the event loop (tokenizing, templating,
grammar compilation) stalls every route, /health included; work done in threads does not.
A probe that gets no answer within the window counts as the window's length.
"""

from __future__ import annotations

import argparse
import random
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.server.app import ServerSettings, create_app
from runtime.server.listen import uvicorn_config


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def heavy_bodies() -> dict[str, dict]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(110_000)]
    many_states = "(" + "|".join(f"(a|b)*c{{{i}}}" for i in range(1, 1500)) + ")"
    return {
        "8 MB prompt": {"text": "lorem ipsum " * 700_000, "sampling_params": {"max_new_tokens": 1}},
        "1 MB regex": {
            "text": "Pick one:",
            "sampling_params": {"max_new_tokens": 4, "regex": "(" + "|".join(words) + ")"},
        },
        "20 kB regex, many states": {
            "text": "Pick one:",
            "sampling_params": {"max_new_tokens": 4, "regex": many_states},
        },
    }


def probe_health(url: str, stop: threading.Event, window_s: float, out: list[float]) -> None:
    with httpx.Client(timeout=window_s) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                client.get(f"{url}/health")
            except httpx.TimeoutException:
                pass
            out.append(time.perf_counter() - start)
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-s", type=float, default=20.0)
    args = parser.parse_args()
    engine = Engine(EngineConfig(max_kv_tokens=8192))
    port = free_port()
    settings = ServerSettings(port=port, max_body_bytes=32 << 20)
    app = create_app(engine, settings)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    print("| heavy request | status | answered in s | /health max ms | /health p50 ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, body in heavy_bodies().items():
        latencies: list[float] = []
        stop = threading.Event()
        prober = threading.Thread(
            target=probe_health, args=(url, stop, args.window_s, latencies), daemon=True
        )
        prober.start()
        start = time.perf_counter()
        try:
            status = httpx.post(f"{url}/generate", json=body, timeout=args.window_s).status_code
        except httpx.TimeoutException:
            status = "timeout"
        took = time.perf_counter() - start
        time.sleep(0.5)
        stop.set()
        prober.join(args.window_s + 5)
        print(
            f"| {name} | {status} | {took:.1f} | {max(latencies) * 1000:,.0f} | "
            f"{statistics.median(latencies) * 1000:,.0f} |",
            flush=True,
        )
    server.should_exit = True


if __name__ == "__main__":
    main()
