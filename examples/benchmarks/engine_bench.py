"""The engine on multi-turn workloads (W1 support agent, W6 chat) vs transformers `generate`.

    python examples/benchmarks/engine_bench.py [--w1-users 16] [--w6-convs 16] [--full-w1]

Conversations advance in batched rounds: every conversation's turn t is submitted at once, and
turn t+1 is built from token ids (prompt + generated ids + the next user message), so the
KV computed while decoding is reusable. Greedy, fp32, both cores. Reports, per engine: wall
time, output tok/s, prefill tokens computed vs the unique prompt tokens (union prefix tree)
and the lower bound (union minus KV computed while decoding), hit rate, evictions, passes.
transformers runs the very same prompts one request at a time (no cross-request reuse).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
from conversations import Conversation, next_prompt

from programs import multi_turn_chat, support_agent
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.prefix import prefill_lower_bound, union_prefix_tokens
from runtime.protocol import GenerateRequest, SamplingParams


@dataclass
class RunRecord:
    prompts: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    wall_s: float = 0.0
    stats: dict = field(default_factory=dict)


def w1_conversations(tokenizer, num_users: int) -> list[Conversation]:
    inputs = support_agent.make_inputs(tokenizer, "bench")
    return [
        Conversation(inputs.system_message(u), list(u.messages), inputs.reply_tokens)
        for u in inputs.users[:num_users]
    ]


def w6_conversations(tokenizer, num_convs: int) -> list[Conversation]:
    inputs = multi_turn_chat.make_inputs(tokenizer, "bench")
    return [
        Conversation(inputs.system_prompt, list(msgs), inputs.reply_tokens)
        for msgs in inputs.conversations[:num_convs]
    ]


def run_engine(config: EngineConfig, convs: list[Conversation]) -> RunRecord:
    with Engine(config) as engine:
        return drive(engine, convs)


def drive(engine: Engine, convs: list[Conversation]) -> RunRecord:
    record = RunRecord()
    before = engine.stats()
    prompts: list[list[int] | None] = [None] * len(convs)
    outputs: list[list[int] | None] = [None] * len(convs)
    start = time.perf_counter()
    for turn in range(len(convs[0].user_messages)):
        prompts = [
            next_prompt(engine.tokenizer, c, turn, p, o)
            for c, p, o in zip(convs, prompts, outputs, strict=True)
        ]
        results = engine.generate(
            [
                GenerateRequest(
                    input_ids=p,
                    sampling=SamplingParams(temperature=0, max_new_tokens=c.reply_tokens),
                )
                for p, c in zip(prompts, convs, strict=True)
            ]
        )
        outputs = [r.output_ids for r in results]
        record.prompts += prompts
        record.outputs += outputs
    record.wall_s = time.perf_counter() - start
    after = engine.stats()
    record.stats = {
        k: after[k] - before[k]
        for k in (
            "prefill_tokens_total",
            "cached_tokens_total",
            "evicted_tokens_total",
            "forward_passes_total",
            "decode_tokens_total",
            "retractions_total",
        )
    }
    record.stats["kv_slots_peak"] = after["kv_slots_peak"]
    return record


def run_hf(hf, record: RunRecord, reply_tokens: int, eos_id: int) -> tuple[float, float]:
    """Same prompts one at a time; returns (wall seconds, share of outputs identical to ours)."""
    same = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, ours in zip(record.prompts, record.outputs, strict=True):
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=reply_tokens,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
            )
            same += out[0, len(prompt) :].tolist() == ours
    return time.perf_counter() - start, same / len(record.prompts)


def row(name: str, record: RunRecord, unique: int, bound: int, hf_wall: float | None) -> str:
    s = record.stats
    computed, cached = s["prefill_tokens_total"], s["cached_tokens_total"]
    out_tokens = sum(len(o) for o in record.outputs)
    hit = cached / (cached + computed) if cached + computed else 0.0
    speedup = f"{hf_wall / record.wall_s:.1f}x" if hf_wall else "-"
    return (
        f"| {name} | {record.wall_s:.1f} | {speedup} | {out_tokens / record.wall_s:.1f} | "
        f"{computed:,} | {unique:,} | {bound:,} | {hit:.1%} | {s['evicted_tokens_total']:,} | "
        f"{s['kv_slots_peak']:,} | {s['forward_passes_total']:,} |"
    )


def bench_workload(
    title: str, convs: list[Conversation], configs: dict[str, EngineConfig], hf, eos_id: int
) -> None:
    records = {name: run_engine(config, convs) for name, config in configs.items()}
    reference = records[next(iter(records))]
    prompts = reference.prompts
    unique = union_prefix_tokens(prompts)
    bound = prefill_lower_bound(
        prompts, list(zip(reference.prompts, reference.outputs, strict=True))
    )
    hf_wall, agree = (None, None)
    if hf is not None:
        hf_wall, agree = run_hf(hf, reference, convs[0].reply_tokens, eos_id)
    total = sum(map(len, prompts))
    print(
        f"\n{title}: {len(convs)} conversations x {len(convs[0].user_messages)} turns, "
        f"{len(prompts)} requests, {total:,} prompt tokens in all\n"
    )
    print(
        "| engine | wall s | vs HF | output tok/s | prefill computed | unique prompt tokens "
        "| lower bound | hit rate | evicted | peak KV slots | forward passes |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, record in records.items():
        print(row(name, record, unique, bound, hf_wall))
    if hf is not None:
        out_tokens = sum(len(o) for o in reference.outputs)
        print(
            f"| transformers generate (request by request) | {hf_wall:.1f} | 1.0x | "
            f"{out_tokens / hf_wall:.1f} | {total:,} | {unique:,} | {bound:,} | 0.0% | - | - "
            f"| - |"
        )
        print(f"\ngreedy outputs identical to ours: {agree:.0%} of requests")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--w1-users", type=int, default=16)
    parser.add_argument("--w6-convs", type=int, default=16)
    parser.add_argument(
        "--full-w1",
        action="store_true",
        help="also W1 at bench size (64 x 3) on our engine (fcfs) alone",
    )
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args()
    common = dict(model="smollm2-135m-instruct", max_kv_tokens=60_000)
    configs = {
        "ours, fcfs": EngineConfig(**common),
        "ours, lpm": EngineConfig(**common, schedule_policy="lpm"),
        "ours, cache disabled": EngineConfig(**common, disable_radix_cache=True),
    }
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    path = resolve_model(common["model"])
    tokenizer = load_tokenizer(path)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bench_workload(
        "W1 support agent", w1_conversations(tokenizer, args.w1_users), configs, hf, eos_id
    )
    bench_workload(
        "W6 multi-turn chat", w6_conversations(tokenizer, args.w6_convs), configs, hf, eos_id
    )
    if args.full_w1:
        bench_workload(
            "W1 support agent at bench size",
            w1_conversations(tokenizer, 64),
            {"ours, fcfs": configs["ours, fcfs"]},
            None,
            eos_id,
        )


if __name__ == "__main__":
    main()
