"""A batch file of the support-agent workload (issue 54): `flowlang batch` against the same
lines sent as independent requests, and a run killed at about half its lines, then resumed.

    python examples/benchmarks/batch_bench.py --lines 1000 --turns 1
    python examples/benchmarks/batch_bench.py --lines 48 --model /path/to/tiny  # a quick look

Lines: W1's conversations (programs/support_agent.py: S, then the few-shot block F or, one
customer in 8, their own retrieved notes R; then `--turns` turns), one
`support_conversation` program run per line (`batch_lines`).

Rows, each a fresh process on the same model and pool:
- flowlang batch: `flowlang batch -i -o --program programs.support_agent` (the file as one
  batch: prefix order, shared prefixes pinned once);
- independent requests: `flowlang serve --program ...`, each line's body POSTed to
  /v1/flowlang/programs/support_conversation by `--clients` concurrent clients in file order
  (what a client without a batch API does); prefill from /metrics;
- the resume experiment: `flowlang batch` killed with SIGKILL once about half the lines are in
  its output, then rerun on the same files; lines lost, duplicated, and recomputed (lines the
  rerun completed beyond those missing), and the wall of each part.
Outputs (greedy) are compared with the batch row's. One run per row: counters exact, walls
indicative (the box's 2 cores; nothing else should run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from serve_bench import free_port, start

from programs.support_agent import batch_lines, make_inputs
from runtime.model.loader import load_tokenizer
from runtime.model.registry import DEFAULT_MODEL, resolve_model

SUMMARY = re.compile(
    r"batch: (\d+) completed, (\d+) failed, (\d+) already done.*? in ([\d.]+) s; prefill (\d+)"
)
PROGRAM_URL = "/v1/flowlang/programs/support_conversation"


def engine_args(args) -> list[str]:
    invariant = ["--batch-invariant"] if args.batch_invariant else []
    return invariant + [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--max-kv-tokens",
        str(args.max_kv_tokens),
    ]


def batch_cmd(args, source: Path, out: Path) -> list[str]:
    flowlang_batch = [sys.executable, "-m", "flowlang", "batch", "--no-progress"]
    files = ["-i", str(source), "-o", str(out), "--program", "programs.support_agent"]
    return flowlang_batch + files + engine_args(args)


def run_batch(args, source: Path, out: Path) -> dict:
    """The batch command's own figures; its wall from the first line on (the model loaded)."""
    done = subprocess.run(batch_cmd(args, source, out), capture_output=True, text=True)
    found = SUMMARY.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(done.stderr[-3000:])
    completed, failed, skipped = map(int, found.groups()[:3])
    wall_s, prefill = float(found[4]), int(found[5])
    return dict(wall_s=wall_s, completed=completed, failed=failed, skipped=skipped, prefill=prefill)


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def variables(path: Path) -> dict[str, dict]:
    return {r["custom_id"]: r["response"]["body"]["variables"] for r in records(path)}


def independent(args, lines: list[dict]) -> dict:
    """The lines POSTed one by one to a server, `--clients` at a time, in file order."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "flowlang",
        "serve",
        "--port",
        str(port),
        "--program",
        "programs.support_agent",
        *engine_args(args),
    ]
    server = start(cmd, url)
    try:
        before = prefill_total(url)
        began = time.monotonic()
        with httpx.Client(timeout=None) as client, ThreadPoolExecutor(args.clients) as pool:
            answers = list(
                pool.map(lambda ln: client.post(url + PROGRAM_URL, json=ln["body"]), lines)
            )
        wall_s = time.monotonic() - began
        prefill = prefill_total(url) - before
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    outputs = {
        ln["custom_id"]: a.json().get("variables") for ln, a in zip(lines, answers, strict=True)
    }
    failed = sum(a.status_code != 200 for a in answers)
    return dict(wall_s=wall_s, prefill=int(prefill), failed=failed, outputs=outputs)


def prefill_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(r"^flowlang_prefill_tokens_total (\S+)$", text, re.M)[1])


def killed_and_resumed(args, source: Path, folder: Path, total: int) -> dict:
    out = folder / "resumed.jsonl"
    victim = subprocess.Popen(
        batch_cmd(args, source, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    while not records(out) and victim.poll() is None:
        time.sleep(0.05)
    began = time.monotonic()  # the first line is in: the model has loaded
    while len(records(out)) < total // 2 and victim.poll() is None:
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    first_s = time.monotonic() - began
    before = {r["custom_id"] for r in records(out)}
    rerun = run_batch(args, source, out)
    final = [r["custom_id"] for r in records(out)]
    return dict(
        killed_after=len(before),
        first_s=first_s,
        rerun=rerun,
        lost=total - len(set(final)),
        duplicated=len(final) - len(set(final)),
        recomputed=rerun["completed"] - (total - len(before)),
        out=out,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-kv-tokens", type=int, default=100_000)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every engine batch-invariant (EngineConfig.batch_invariant): greedy outputs "
        "then do not depend on which lines share a step, so the rows' outputs compare equal",
    )
    parser.add_argument("--skip-independent", action="store_true")
    args = parser.parse_args()
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    inputs = make_inputs(load_tokenizer(tokenizer_dir), "bench", users=args.lines, turns=args.turns)
    lines = batch_lines(inputs)
    folder = Path(tempfile.mkdtemp(prefix="batch-bench-"))
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    batch = run_batch(args, source, folder / "batch.jsonl")
    alone = independent(args, lines) if not args.skip_independent else None
    resume = killed_and_resumed(args, source, folder, len(lines))
    reference = variables(folder / "batch.jsonl")
    same_resumed = sum(variables(resume["out"]).get(k) == v for k, v in reference.items())
    invariant = ", --batch-invariant" if args.batch_invariant else ""
    print(
        f"\n{len(lines)} lines x {args.turns} turn(s), {args.model} {args.dtype}{invariant}, "
        f"--max-kv-tokens {args.max_kv_tokens}\n"
    )
    print("| row | wall s | prefill computed | failed | outputs equal to the batch's |")
    print("| --- | ---: | ---: | ---: | ---: |")
    print(
        f"| flowlang batch | {batch['wall_s']:.1f} | {batch['prefill']:,} | {batch['failed']} | - |"
    )
    if alone is not None:
        same_alone = sum(alone["outputs"].get(k) == v for k, v in reference.items())
        print(
            f"| independent requests ({args.clients} clients) | {alone['wall_s']:.1f} | "
            f"{alone['prefill']:,} | {alone['failed']} | {same_alone}/{len(reference)} |"
        )
    rerun = resume["rerun"]
    print(
        f"\nkilled (SIGKILL) after {resume['killed_after']} lines, {resume['first_s']:.1f} s; "
        f"resumed: {rerun['completed']} lines in {rerun['wall_s']:.1f} s "
        f"(prefill {rerun['prefill']:,}); lost {resume['lost']}, duplicated "
        f"{resume['duplicated']}, recomputed {resume['recomputed']}; outputs equal "
        f"{same_resumed}/{len(reference)}"
    )


if __name__ == "__main__":
    main()
