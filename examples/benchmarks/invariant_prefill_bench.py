"""A batch-invariant bf16 engine's prefill with each extend's GEMM alone (what it runs) against
all extends' rows in one GEMM (what it ran before: not batch-invariant in bf16).

    python examples/benchmarks/invariant_prefill_bench.py [--batches 4 16] [--repeats 6]

W1's first turns (spec_bench's requests), `--batches` of them at once as 1-token generations on
a flushed cache, on the default model in bf16 with EngineConfig(batch_invariant=True). The two
ways alternate within one engine (every Linear's `_dense_rows_alike` flipped: True is the single
GEMM), interleaved; medians. Prints whether the two gave the same tokens (they need not: the
single GEMM's rounding depends on the batch, which is what the per-extend GEMMs remove).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_bench import one_token, request_workloads  # noqa: E402

from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.model.linear import Linear  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    engine = Engine(EngineConfig(dtype="bfloat16", max_kv_tokens=40_000, batch_invariant=True))
    linears = [o for o in gc.get_objects() if isinstance(o, Linear)]
    requests = request_workloads(engine.tokenizer, max(args.batches))["w1"]
    print("| prompts | tokens | one GEMM s | a GEMM per extend s | ratio | same tokens |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for batch in args.batches:
        batch_reqs = [one_token(r) for r in requests[:batch]]
        seconds: dict[bool, list[float]] = {True: [], False: []}
        outputs = {}
        for _ in range(args.repeats):
            for at_once in seconds:
                for linear in linears:
                    linear._dense_rows_alike = at_once
                engine.flush_cache()
                start = time.perf_counter()
                results = engine.generate(batch_reqs)
                seconds[at_once].append(time.perf_counter() - start)
                outputs[at_once] = [r.output_ids for r in results]
        once, each = (statistics.median(s) for s in seconds.values())
        tokens = sum(len(r.input_ids) for r in batch_reqs)
        print(
            f"| {batch} | {tokens:,} | {once:.2f} | {each:.2f} | {each / once:.2f}x "
            f"| {'yes' if outputs[True] == outputs[False] else 'no'} |"
        )
    engine.close()


if __name__ == "__main__":
    main()
