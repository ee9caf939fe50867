"""Running one engine's worker in a fresh process for the side-by-side benchmarks
(peer_bench.py, decode_bench.py), and the CPU-bound neighbours measured runs sit beside. Standard
library only: vLLM's workers import it from vLLM's own
venv."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    """The hidden options a script's worker process is started with."""
    parser.add_argument("--worker", choices=["flowlang", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def run_worker(
    script: str,
    python: str,
    label: str,
    worker: str,
    spec_path: Path,
    dtype: str,
    extra_args: tuple[str, ...] = (),
    pythonpath: Path | None = None,
    env_overrides: dict[str, str] | None = None,
) -> dict:
    """Runs `script --worker worker` under `python` on both cores (vLLM's threads bound to them,
    4 GiB of KV) from the repo root; returns the JSON record it wrote. `pythonpath`: import the
    runtime from another checkout; `env_overrides`: more environment for the worker."""
    out_path = spec_path.with_name(f"{label}-{dtype}-{time.monotonic_ns()}.json")
    env = dict(os.environ)
    env.update(VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4")
    env.update(env_overrides or {})
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    cmd = [python, script, "--worker", worker, "--spec", str(spec_path), "--dtype", dtype]
    cmd += ["--out", str(out_path), *extra_args]
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out_path.read_text())


def start_neighbours(count: int) -> list[subprocess.Popen]:
    """`count` pure-Python busy loops: a user's machine is rarely quiet."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def stop_neighbours(neighbours: list[subprocess.Popen]) -> None:
    for proc in neighbours:
        proc.kill()
        proc.wait()
