"""flowlang against llama.cpp on the same weights and threads (issue 53, item 3), in one run,
interleaved, medians: batch-1 and batch-8 decode after 16 and 1,024 tokens, prefill of 512
tokens, a cold fork, and the box's memory bandwidth (a STREAM triad) beside them.

    python examples/benchmarks/llama_cpp_bench.py --llama-server BUILD/bin/llama-server \
        --gguf-dir DIR [--rounds 3] [--flowlang LABEL ...]

DIR holds the default model as GGUF files named smollm2-135m-{q4_1,q4_k_m,q8_0,bf16,f32}.gguf
(the Q4_1 file is the one the registry ships; llama.cpp's convert_hf_to_gguf.py makes the F32,
BF16 and Q8_0 ones from the same weights, and its llama-quantize the Q4_K_M one from the F32).
llama.cpp: `llama-server -t 2 -tb 2 -np 8`, prompt caching on (its default), one server per
format. flowlang: a fresh process per configuration: bf16 and fp32 on the Q4_1 file
dequantized (`gguf_blocks=False`), each also on its blocks (`gguf_blocks`, the default: the
projections' and the LM head's decode rows on the file's own blocks), and bf16 on the Q4_K_M
file's blocks (Q5_0, Q4_K, Q6_K and Q8_0 tensors).

The same method for both, from the caller: decode tok/s = B x 64 / (t(65 tokens) - t(1 token))
for B prompts already cached (prefill and its noise cancel); prefill tok/s = 512 / t(1 token)
for a fresh 512-token prompt; cold fork: 4 requests sent together, each a 2,000-token trunk
(fresh each round) plus its own 16 tokens, 32 new tokens each: wall and prompt tokens computed
(flowlang: its counter; llama.cpp: each response's timings.prompt_n). Token ids are random,
seeded, away from special tokens (both engines read the same vocabulary). A round runs every
configuration once, triad first; figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from decode_bench import decode_rate
from serve_bench import free_port

SPEC = {
    "contexts": [16, 1024],
    "batches": [1, 8],
    "new_tokens": 64,
    "prefill_tokens": 512,
    "trunk_tokens": 2000,
    "branches": 4,
    "branch_tokens": 16,
    "branch_new_tokens": 32,
}
# dtype[+file[+int8]]: no file, the registry's Q4_1 GGUF dequantized (--no-gguf-blocks); +blocks,
# the same file with its decode rows on its blocks (the default); +q4_k_m, DIR's Q4_K_M file
# likewise; +int8, every row on the blocks with activations rounded to int8 per block
# (--quantize-activations, llama.cpp's way)
FLOWLANG = ["bfloat16", "float32", "bfloat16+blocks", "float32+blocks", "bfloat16+q4_k_m"]
FLOWLANG_MORE = ["bfloat16+blocks+int8", "float32+blocks+int8"]
LLAMA_FORMATS = ["q4_1", "q4_k_m", "q8_0", "bf16", "f32"]


def ids(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(count)]


def figures(generate, round_index: int) -> dict:
    """One round's figures; generate(prompts, n) returns the prompt tokens it computed."""
    out: dict = {}
    for context in SPEC["contexts"]:
        for batch in SPEC["batches"]:
            prompts = [ids(f"{context}-{batch}-{i}", context) for i in range(batch)]
            generate(prompts, 2)  # prefilled once: the timed calls find them cached
            out[f"decode b{batch} @{context}"] = decode_rate(generate, prompts, SPEC["new_tokens"])
    fresh = ids(f"prefill-{round_index}", SPEC["prefill_tokens"])
    began = time.perf_counter()
    generate([fresh], 1)
    out["prefill 512"] = SPEC["prefill_tokens"] / (time.perf_counter() - began)
    trunk = ids(f"trunk-{round_index}", SPEC["trunk_tokens"])
    branches = [
        trunk + ids(f"branch-{round_index}-{b}", SPEC["branch_tokens"])
        for b in range(SPEC["branches"])
    ]
    began = time.perf_counter()
    out["fork computed"] = generate(branches, SPEC["branch_new_tokens"])
    out["fork wall s"] = time.perf_counter() - began
    return out


def flowlang_worker(label: str, round_index: int, gguf_dir: Path) -> dict:
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    dtype, _, blocks = label.partition("+")
    blocks, _, activations = blocks.partition("+")
    model = "smollm2-135m-instruct"
    if blocks not in ("", "blocks"):  # another GGUF of the same weights, run on its blocks
        model = str(gguf_dir / f"smollm2-135m-{blocks}.gguf")
    config = EngineConfig(
        model=model,
        dtype=dtype,
        gguf_blocks=bool(blocks),
        quantize_activations=activations == "int8",
        max_kv_tokens=40_000,
    )
    with Engine(config) as engine:

        def generate(prompts, n):
            before = engine.stats()["prefill_tokens_total"]
            sampling = SamplingParams(temperature=0, max_new_tokens=n, min_new_tokens=n)
            results = engine.generate(
                [GenerateRequest(input_ids=p, sampling=sampling) for p in prompts]
            )
            assert all(len(r.output_ids) == n for r in results)
            return engine.stats()["prefill_tokens_total"] - before

        return figures(generate, round_index)


class LlamaServer:
    """`llama-server` on both threads with `slots` parallel slots of `slot_tokens` each."""

    def __init__(self, binary: str, gguf: Path, slots: int = 8, slot_tokens: int = 0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        slot_tokens = slot_tokens or max(SPEC["contexts"]) + SPEC["trunk_tokens"] + 200
        threads = ["-t", "2", "-tb", "2", "-np", str(slots), "-c", str(slots * slot_tokens)]
        cmd = [binary, "-m", str(gguf), *threads, "--port", str(self.port), "--no-webui"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read()[-2000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama-server did not come up")

    def generate(self, prompts, n) -> int:
        """Exactly `n` tokens for each prompt at once; the prompt tokens it computed."""
        return self.complete(prompts, n, ignore_eos=True)[1]

    def complete(self, prompts, n, ignore_eos: bool = False) -> tuple[list[list[int]], int]:
        """Greedy completions of token-id prompts, sent together (cached prompts reused):
        (output ids each, prompt tokens computed in all)."""

        def one(prompt):
            body = {"prompt": prompt, "n_predict": n, "cache_prompt": True,
                    "ignore_eos": ignore_eos, "temperature": 0, "samplers": ["top_k"],
                    "top_k": 1, "return_tokens": True}  # fmt: skip
            answer = httpx.post(self.url + "/completion", json=body, timeout=3600).json()
            assert not ignore_eos or answer["tokens_predicted"] == n, answer
            return answer["tokens"], answer["timings"]["prompt_n"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            done = list(pool.map(one, prompts))
        return [tokens for tokens, _ in done], sum(computed for _, computed in done)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def triad_gb_s() -> float:
    """A STREAM triad (a = b + s*c) over 3 x 512 MiB float32 arrays on 2 threads: GB/s moved
    (three arrays' bytes), the best of 5 (STREAM's own rule)."""
    import torch

    torch.set_num_threads(2)
    n = 512 * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    best_s = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best_s = min(best_s, time.perf_counter() - began)
    return 3 * n * 4 / best_s / 1e9


def run_flowlang(label: str, round_index: int, folder: Path, gguf_dir: Path) -> dict:
    out = folder / f"{label}-{round_index}.json"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        label,
        "--round",
        str(round_index),
        "--out",
        str(out),
        "--gguf-dir",
        str(gguf_dir),
    ]
    subprocess.run(cmd, check=True, cwd=Path(__file__).resolve().parents[2])
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help="default: flowlang's rows only")
    parser.add_argument("--gguf-dir", type=Path)
    parser.add_argument("--flowlang", nargs="+", default=FLOWLANG,
                        choices=FLOWLANG + FLOWLANG_MORE, help="flowlang's rows")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.out.write_text(json.dumps(flowlang_worker(args.worker, args.round, args.gguf_dir)))
        return
    folder = Path(tempfile.mkdtemp(prefix="llama-cpp-bench-"))
    rows: dict[str, list[dict]] = {}
    triads = []
    for round_index in range(args.rounds):
        triads.append(triad_gb_s())
        for label in args.flowlang:
            rows.setdefault(f"flowlang {label}", []).append(
                run_flowlang(label, round_index, folder, args.gguf_dir)
            )
        for fmt in LLAMA_FORMATS if args.llama_server else []:
            server = LlamaServer(args.llama_server, args.gguf_dir / f"smollm2-135m-{fmt}.gguf")
            try:
                rows.setdefault(f"llama.cpp {fmt.upper()}", []).append(
                    figures(server.generate, round_index)
                )
            finally:
                server.close()
        print(f"[round {round_index + 1} of {args.rounds} done]", file=sys.stderr, flush=True)
    print_table(rows, triads, args.rounds)


def print_table(rows: dict[str, list[dict]], triads: list[float], rounds: int) -> None:
    names = list(next(iter(rows.values()))[0])
    print(
        f"\nSTREAM triad (2 threads): {statistics.median(triads):.1f} GB/s median "
        f"({', '.join(f'{t:.1f}' for t in triads)}); medians of {rounds} rounds; decode and "
        "prefill in tok/s\n"
    )
    print("| engine | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for engine, runs in rows.items():
        cells = [statistics.median(run[name] for run in runs) for name in names]
        print(
            f"| {engine} | "
            + " | ".join(f"{c:,.1f}" if c < 100 else f"{c:,.0f}" for c in cells)
            + " |"
        )


if __name__ == "__main__":
    main()
