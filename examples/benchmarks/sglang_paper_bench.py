"""The programs of SGLang's RadixAttention paper, unchanged, on flowlang: radix cache on vs off.

    python examples/benchmarks/sglang_paper_bench.py [--programs mmlu,react,...] [--num N]
        [--scale 0.25] [--repeats 1] [--neighbour [N]] [--max-kv-tokens 40000]

The 15 programs of sglang_paper_programs.py (SGLang's benchmark/*/bench_sglang.py, only the
import changed: `import flowlang.sglang as sgl`) on synthetic inputs of the datasets' shapes,
each run as SGLang's bench runs it (run_batch with its keywords; generative agents' calls one
by one; json_decode_regex's warm-up first, not measured) on the default model, greedy, in-process
(LocalBackend), twice: on an engine with the radix cache and on one with
`EngineConfig(disable_radix_cache=True)`. Each run starts from an empty cache. Per program:
  unchanged    the program ran without an error in both modes;
  requests / sent / lower bound    what the cache-on run's recorded requests hold
               (backend.prompt_report(): generation and scoring requests, their prompt tokens,
               and the prefill lower bound: unique prompt tokens minus the KV decoding computed;
               a sampled program's cache-off run sends other prompts);
  prefill on / off    prompt tokens the engine computed (its prefill_tokens_total);
  on - bound   what the cache-on run computed beyond the lower bound;
  off - sent   what the cache-off run computed beyond the prompt tokens it sent (its own
               requests': a sampled program sends other prompts in each run);
  hit on       the cache-on run's token hit rate (cached / (cached + computed));
  wall on / off, off/on    seconds (median of --repeats), and the speed-up of the cache;
  same outputs every variable, text and return value equal on vs off ("sampled": a gen of
               the program sets temperature > 0, as the trees of thought do: not compared).
`--num` sets every program's number of instances (default: BENCH_NUM, sized for a 2-core CPU);
`--scale` multiplies the inputs' text lengths (1.0: about the datasets'). `--neighbour` runs N
(default 1) CPU-bound processes beside the measured runs (pure Python busy loops).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import sglang_paper_programs as paper
from side_by_side import start_neighbours, stop_neighbours

from flowlang.backends.local import LocalBackend
from runtime.config import EngineConfig
from runtime.engine import Engine

MODEL = "smollm2-135m-instruct"
MAX_KV_TOKENS = 40_000  # per engine (~1.8 GB of fp32 KV each): the largest working set fits
# instances per program for a 2-core CPU (the bench's own defaults: Spec.default_num)
BENCH_NUM = {
    "mmlu": 10,
    "hellaswag": 1,  # scores 4 endings after a 20-shot prefix (~1,300 tokens)
    "gsm8k": 2,  # up to 512 tokens each
    "tree_of_thought_v0": 1,  # 39 gens of up to 256 sampled tokens
    "tree_of_thought_deep": 1,  # 30 gens of up to 256 sampled tokens
    "react": 2,
    "generative_agents": 10,
    "json_decode_regex": 2,
    "json_jump_forward": 2,
    "multi_turn_chat": 4,
    "llm_judge": 1,  # 6 forks of up to 256 tokens
    "tip_suggestion": 1,  # 5 tips, 5 nested expansions of up to 128 tokens
    "multi_document_qa": 2,
    "long_json_decode": 1,
    "line_retrieval": 4,
}
COUNTERS = ("prefill_tokens_total", "cached_tokens_total")


def measure(engine: Engine, spec: paper.Spec, num: int, scale: float) -> dict[str, Any]:
    """One run from an empty cache: wall, the engine's counters meanwhile, the outputs."""
    engine.flush_cache()
    backend = LocalBackend(engine, record=True)
    before = engine.stats()
    start = time.perf_counter()
    try:
        states = paper.run(spec, num, scale, backend, warm_up=False)
        outputs = paper.outputs(states)
    except Exception as err:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(err).__name__}: {err}"}
    wall = time.perf_counter() - start
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in COUNTERS}
    return {
        "wall": wall,
        "outputs": outputs,
        "report": backend.prompt_report(),
        "pins": after["num_pins"],
        **delta,
    }


def warm(engines: dict[str, Engine], specs: list[paper.Spec]) -> None:
    """The CPU kernels, the chat template and the grammars once per engine (not measured);
    json_decode_regex's warm-up program, as its bench runs it before timing."""
    for engine in engines.values():
        measure(engine, paper.PROGRAMS["mmlu"], 1, 0.05)
        for spec in specs:
            if spec.warm_up is not None:
                backend = LocalBackend(engine)
                spec.warm_up.run(backend=backend, temperature=0).sync()


def row(name: str, spec: paper.Spec, runs: dict[str, list[dict]]) -> str:
    errors = [r["error"] for mode in runs for r in runs[mode] if "error" in r]
    if errors:
        return f"| {name} | no: {errors[0][:120]} |" + " - |" * 12
    on, off = runs["on"][0], runs["off"][0]
    report = on["report"]
    wall_on = statistics.median(r["wall"] for r in runs["on"])
    wall_off = statistics.median(r["wall"] for r in runs["off"])
    prompt = on["prefill_tokens_total"] + on["cached_tokens_total"]
    hit = on["cached_tokens_total"] / prompt if prompt else 0.0
    if spec.sampled and spec.mode != "calls":
        same = "sampled"
    else:
        same = "yes" if on["outputs"] == off["outputs"] else "NO"
    pins = "" if on["pins"] == off["pins"] == 0 else f" (pins left: {on['pins']}/{off['pins']})"
    return (
        f"| {name} | yes{pins} | {report['requests']:,} | {report['prompt_tokens']:,} | "
        f"{report['lower_bound']:,} | {on['prefill_tokens_total']:,} | "
        f"{off['prefill_tokens_total']:,} | {on['prefill_tokens_total'] - report['lower_bound']:+,}"
        f" | {off['prefill_tokens_total'] - off['report']['prompt_tokens']:+,} | {hit:.1%}"
        f" | {wall_on:.1f} | {wall_off:.1f} | {wall_off / wall_on:.2f}x | {same} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default=",".join(paper.PROGRAMS))
    parser.add_argument("--num", type=int, help="instances per program (default: BENCH_NUM)")
    parser.add_argument("--scale", type=float, default=0.25, help="text lengths (1: datasets')")
    parser.add_argument("--repeats", type=int, default=1, help="wall: median of this many")
    parser.add_argument(
        "--neighbour",
        type=int,
        nargs="?",
        const=1,
        default=0,
        help="CPU-bound processes beside the runs (default 1 when given)",
    )
    parser.add_argument("--max-kv-tokens", type=int, default=MAX_KV_TOKENS)
    args = parser.parse_args()  # fmt: skip
    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(paper.PROGRAMS))
    if unknown:
        parser.error(f"unknown programs {unknown}; known: {', '.join(paper.PROGRAMS)}")
    specs = [paper.PROGRAMS[n] for n in names]

    engines = {
        "on": Engine(EngineConfig(model=MODEL, max_kv_tokens=args.max_kv_tokens)),
        "off": Engine(
            EngineConfig(model=MODEL, max_kv_tokens=args.max_kv_tokens, disable_radix_cache=True)
        ),
    }
    neighbours: list[subprocess.Popen] = []
    total = time.perf_counter()
    try:
        warm(engines, specs)
        neighbours = start_neighbours(args.neighbour)
        print(
            f"\n{MODEL}, fp32, greedy (the trees of thought sample at their gens' temperature),"
            f" scale {args.scale}, wall median of {args.repeats}"
            + (f", beside {args.neighbour} CPU-bound neighbour(s)" if args.neighbour else "")
            + "\n"
        )
        print(
            "| program (instances) | unchanged | requests | sent | lower bound | prefill on | "
            "prefill off | on - bound | off - sent | hit on | wall on s | wall off s | off/on | "
            "same outputs |"
        )
        print("| --- | --- |" + " ---: |" * 11 + " --- |", flush=True)
        for name, spec in zip(names, specs, strict=True):
            num = args.num or BENCH_NUM[name]
            runs: dict[str, list[dict]] = {"on": [], "off": []}
            for repeat in range(args.repeats):
                for mode in ("on", "off") if repeat % 2 == 0 else ("off", "on"):
                    result = measure(engines[mode], spec, num, args.scale)
                    runs[mode].append(result)
                    wall = f"{result['wall']:.1f} s" if "wall" in result else result["error"]
                    print(f"[{name} x{num}, cache {mode}, #{repeat + 1}] {wall}", file=sys.stderr)
            print(row(f"{name} ({num})", spec, runs), flush=True)
    finally:
        stop_neighbours(neighbours)
        for engine in engines.values():
            engine.close()
    print(f"\n{time.perf_counter() - total:.0f} s in all (both engines' warm-up included)")


if __name__ == "__main__":
    main()
