"""W1 on a quiet machine and beside CPU-bound neighbours: native kernels vs the torch path.

    python examples/benchmarks/busy_bench.py [--users 16] [--repeats 3] [--dtype float32] \
        [--neighbours 1] [--baseline DIR] [--paths native torch] [--variant NAME=VAR=VALUE ...]

Users' machines are rarely quiet: a build, a browser or a second server takes cores from the
engine. Each cell runs peer_bench.py's flowlang worker (W1 support agent, rounds, greedy) in a
fresh process, once alone and once while `--neighbours` processes spin on the CPU (pure Python
busy loops, started before the worker and killed after it), for each kernel path: native
(the default) and torch (FLOWLANG_NATIVE_KERNELS=0). `--baseline DIR` adds an older checkout's
engine ("before"; its torch path is forced by a compiler that does not exist and an empty
extension cache). `--variant` adds environment variants of this checkout, e.g.
`--variant spin=GOMP_SPINCOUNT=10000 passive=OMP_WAIT_POLICY=PASSIVE`. Prints medians of the
rounds' total wall time over repeats (cells interleaved per repeat) and the slowdown beside
the neighbours.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

from peer_bench import w1_spec
from side_by_side import run_worker, start_neighbours, stop_neighbours

PEER_BENCH = str(Path(__file__).with_name("peer_bench.py"))
TORCH_PATH = {"FLOWLANG_NATIVE_KERNELS": "0"}


def baseline_torch_path(scratch: Path) -> dict[str, str]:
    """An older checkout has no switch: its kernel build fails and it falls back."""
    return {"CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(scratch / "no-extensions")}


def cells(args: argparse.Namespace, scratch: Path) -> dict[str, tuple[Path | None, dict]]:
    """label -> (code to import, environment overrides)."""
    out: dict[str, tuple[Path | None, dict]] = {"native": (None, {}), "torch": (None, TORCH_PATH)}
    for variant in args.variant:
        name, _, assignment = variant.partition("=")
        var, _, value = assignment.partition("=")
        out[f"native, {name}"] = (None, {var: value})
    if args.baseline:
        out["before: native"] = (args.baseline, {})
        out["before: torch"] = (args.baseline, baseline_torch_path(scratch))
    path = {label: "torch" if "torch" in label else "native" for label in out}
    return {label: cell for label, cell in out.items() if path[label] in args.paths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--neighbours", type=int, default=1)
    parser.add_argument("--baseline", type=Path, help="an older checkout, run as 'before'")
    parser.add_argument("--variant", nargs="*", default=[], help="NAME=VAR=VALUE")
    parser.add_argument("--paths", nargs="+", default=["native", "torch"], help="kernel paths")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    spec_path = scratch / "spec.json"
    spec_path.write_text(json.dumps(w1_spec(args.users)))
    walls: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    todo = cells(args, scratch)
    for repeat in range(args.repeats):
        order = list(todo) if repeat % 2 == 0 else list(reversed(todo))
        for label in order:
            code, env = todo[label]
            for where in ("alone", "beside"):
                neighbours = start_neighbours(args.neighbours) if where == "beside" else []
                try:
                    record = run_worker(
                        PEER_BENCH, sys.executable, label.replace(" ", ""), "flowlang",
                        spec_path, args.dtype, pythonpath=code, env_overrides=env,
                    )  # fmt: skip
                finally:
                    stop_neighbours(neighbours)
                wall = sum(r["wall_s"] for r in record["rounds"])
                walls[label, where].append(wall)
                print(f"[repeat {repeat + 1}] {label}, {where}: {wall:.1f} s", flush=True)
    print(
        f"\nW1 {args.users} users x 3 turns, {args.dtype}; wall s, medians of {args.repeats}; "
        f"beside = {args.neighbours} CPU-bound neighbour process(es)"
    )
    print("\n| engine | alone | beside | beside / alone |")
    print("| --- | ---: | ---: | ---: |")
    for label in todo:
        alone = statistics.median(walls[label, "alone"])
        beside = statistics.median(walls[label, "beside"])
        print(f"| {label} | {alone:.1f} | {beside:.1f} | {beside / alone:.2f}x |")


if __name__ == "__main__":
    main()
