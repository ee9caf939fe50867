"""Radix-tree walks per admitted request: root-to-node descents (match_prefix + insert calls).

    python examples/benchmarks/tree_walks_bench.py [--users 8]

W1 (support agent), every user's turn t then t+1, default model, greedy; the counts come from
wrapping RadixCache.match_prefix and RadixCache.insert, so the same script measures any
checkout (run it with that checkout first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

from runtime.cache.radix import RadixCache
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.model.loader import load_tokenizer
from runtime.model.registry import resolve_model

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import engine_bench  # noqa: E402 - the W1 driver shared with engine_bench.py

CALLS: collections.Counter[str] = collections.Counter()


def count_calls(name: str) -> None:
    original = getattr(RadixCache, name)

    def counted(self, *args, **kwargs):
        CALLS[name] += 1
        return original(self, *args, **kwargs)

    setattr(RadixCache, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=8)
    args = parser.parse_args()
    for name in ("match_prefix", "insert"):
        count_calls(name)
    tokenizer = load_tokenizer(resolve_model("smollm2-135m-instruct"))
    convs = engine_bench.w1_conversations(tokenizer, args.users)
    print(
        "| config | admitted | match_prefix | insert | walks per admission "
        "| prefill, passes, evicted |"
    )
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for policy, eviction, kv_tokens in (
        ("fcfs", "lru", 60_000),
        ("lpm", "lru", 60_000),
        ("lpm", "graph", 5_000),
    ):
        CALLS.clear()
        config = EngineConfig(
            schedule_policy=policy, eviction_policy=eviction, max_kv_tokens=kv_tokens
        )
        with Engine(config) as engine:
            record = engine_bench.drive(engine, convs)
            stats = engine.stats()
        admitted = stats["requests_finished_total"] + stats["retractions_total"]
        walks = CALLS["match_prefix"] + CALLS["insert"]
        s = record.stats
        print(
            f"| {policy}, {eviction}, {kv_tokens:,} slots | {admitted} | {CALLS['match_prefix']} | "
            f"{CALLS['insert']} | {walks / admitted:.2f} | {s['prefill_tokens_total']:,}, "
            f"{s['forward_passes_total']}, {s['evicted_tokens_total']:,} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
