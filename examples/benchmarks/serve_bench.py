"""Serving throughput and latency on loopback: our server vs vLLM's OpenAI server (CPU build).

    python examples/benchmarks/serve_bench.py [--vllm-python /path/to/vllm-venv/bin/python]

Each run starts the server as a subprocess on the default model (the same safetensors folder
for both engines), then 1, 8 and 32 concurrent clients each send streaming /v1/completions
requests (a shared 200-token system preamble, a distinct ~60-token question, 64 new tokens,
EOS ignored) for a fixed number of requests per client. Reports output tok/s, TTFT and
inter-token latency percentiles (p50 / p90), measured by the clients. vLLM runs with both
cores (VLLM_CPU_OMP_THREADS_BIND=0-1), as ENVIRONMENT.md advises; it is never a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

MODEL = "smollm2-135m-instruct"
NEW_TOKENS = 64


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(cmd: list[str], url: str, env: dict | None = None, timeout: float = 600, log=None):
    """`cmd` started, once `url` answers /v1/models. `log`: a file for its stderr (a server
    that logs as it serves would fill a pipe nobody reads and stall), default a pipe."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=log or subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = proc.stderr.read() if log is None else Path(log.name).read_text()
            raise RuntimeError(f"server exited: {tail[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("server did not come up")


def prompts(count: int) -> list[str]:
    preamble = (
        "You are the support agent of Northwind Goods. Answer briefly, name the next "
        "step, and never promise dates the warehouse has not confirmed. "
    ) * 6
    return [
        f"{preamble}\nCustomer {i}: my order {1000 + i} arrived damaged; what now?\nAgent:"
        for i in range(count)
    ]


def client(url: str, model: str, texts: list[str], out: list[dict]) -> None:
    with httpx.Client(base_url=url, timeout=600) as c:
        for text in texts:
            body = {
                "model": model,
                "prompt": text,
                "max_tokens": NEW_TOKENS,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
            start = time.perf_counter()
            stamps = []
            with c.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0].get("text"):
                            stamps.append(time.perf_counter())
            out.append(
                {
                    "ttft": stamps[0] - start,
                    "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                    "tokens": NEW_TOKENS,
                    "end": time.perf_counter(),
                    "start": start,
                }
            )


def load(url: str, model: str, concurrency: int, per_client: int) -> dict:
    texts = prompts(concurrency * per_client)
    results: list[dict] = []
    threads = [
        threading.Thread(
            target=client, args=(url, model, texts[i * per_client : (i + 1) * per_client], results)
        )
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(x for r in results for x in r["itl"])

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    return {
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft": (pct(ttft, 0.5), pct(ttft, 0.9)),
        "itl": (pct(itl, 0.5), pct(itl, 0.9)),
        "requests": len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    parser.add_argument("--per-client", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    from runtime.model.registry import resolve_model

    folder = str(resolve_model(MODEL))
    engines = {"flowlang": None}
    if args.vllm_python and Path(args.vllm_python).exists():
        engines["vllm-cpu"] = args.vllm_python
    rows = []
    for name, python in engines.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if python is None:
            cmd = [
                sys.executable,
                "-m",
                "flowlang",
                "serve",
                "--model",
                MODEL,
                "--port",
                str(port),
                "--max-kv-tokens",
                "60000",
            ]
            env, model = None, MODEL
        else:
            cmd = [
                python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                folder,
                "--port",
                str(port),
                "--dtype",
                "float32",
                "--max-model-len",
                "4096",
            ]
            env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "4"}
            model = folder
        proc = start(cmd, url, env)
        try:
            load(url, model, 2, 1)  # warm up
            for concurrency in args.concurrency:
                rows.append((name, concurrency, load(url, model, concurrency, args.per_client)))
        finally:
            proc.terminate()
            proc.wait(60)
    print(
        f"\n{MODEL}, fp32, streaming /v1/completions, {NEW_TOKENS} new tokens, "
        f"{args.per_client} requests per client\n"
    )
    print(
        "| engine | clients | output tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, concurrency, r in rows:
        print(
            f"| {name} | {concurrency} | {r['tok_s']:.1f} | {r['ttft'][0]:.0f} | "
            f"{r['ttft'][1]:.0f} | {r['itl'][0]:.1f} | {r['itl'][1]:.1f} |"
        )
    if len(engines) == 1:
        print("\n(vllm-cpu not given: pass --vllm-python to compare)")


if __name__ == "__main__":
    main()
