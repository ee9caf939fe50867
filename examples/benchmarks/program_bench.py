"""flowlang programs (W1-W4, W6) on the default model vs the same prompts as independent
requests vs transformers, and graph-aware eviction vs LRU vs the offline optimum.

    python examples/benchmarks/program_bench.py [--skip-hf] [--skip-eviction]

Part 1, per workload, one run each, greedy, fp32:
  flowlang      run_batch on the engine: graph hints, fork pins, batch pins, trie scoring;
  independent   the very requests flowlang sent, replayed as plain requests without hints,
                pins or scoring (a select's choices become one prefill request each), fcfs,
                request k of every instance submitted together (the same dependencies);
  transformers  the same generation prompts one by one with `generate`, choices scored by a
                forward pass each.
Part 2: W1 with a KV pool of 25% of its working set: token hit rate under "graph" and "lru"
eviction in the engine, and the recorded trace replayed under LRU and under the offline optimum
(farthest next use, Belady).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from flowlang.backends.local import LocalBackend
from programs import fewshot_choice, judge, multi_turn_chat, support_agent, tree_of_thought
from runtime.cache.replay import replay, working_set
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import GenerateRequest, SamplingParams

MODEL = "smollm2-135m-instruct"


def workloads(tokenizer, scale: dict[str, int]) -> dict[str, tuple]:
    w1 = support_agent.make_inputs(tokenizer, "bench")
    w1 = type(w1)(w1.system_prompt, w1.fewshot, w1.users[: scale["W1"]])
    subjects = fewshot_choice.make_inputs(tokenizer, "bench")[:2]
    subjects = tuple(type(s)(s.name, s.shots, s.questions[: scale["W2"]]) for s in subjects)
    w6 = multi_turn_chat.make_inputs(tokenizer, "bench")
    w6 = type(w6)(w6.system_prompt, w6.conversations[: scale["W6"]])
    return {
        "W1 support agent": (support_agent.support_agent, support_agent.batch_args(w1)),
        "W2 few-shot choice": (fewshot_choice.fewshot_choice, fewshot_choice.batch_args(subjects)),
        "W3 tree of thought": (
            tree_of_thought.tree_of_thought,
            [
                {"question": q}
                for q in tree_of_thought.make_inputs(tokenizer, "bench")[: scale["W3"]]
            ],
        ),
        "W4 judge": (
            judge.judge,
            [{"case": c} for c in judge.make_inputs(tokenizer, "bench")[: scale["W4"]]],
        ),
        "W6 chat": (multi_turn_chat.multi_turn_chat, multi_turn_chat.batch_args(w6)),
    }


def run_flowlang(program, batch) -> tuple[float, dict, LocalBackend]:
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=60_000)) as engine:
        backend = LocalBackend(engine, record=True)
        start = time.perf_counter()
        states = program.run_batch(batch, backend=backend, progress=False)
        wall = time.perf_counter() - start
        failed = [s for s in states if not hasattr(s, "text")]
        assert not failed, failed
        stats = engine.stats()
        backend.engine = None  # the log stays; the engine goes
        return wall, stats, backend


def rounds(backend: LocalBackend) -> list[list]:
    """The recorded requests grouped by dependency depth: a request that contains an earlier
    one's prompt and (the start of) its output comes one round later; the rest run together."""
    items = [("gen", r, list(r.input_ids)) for r, _ in backend.generations]
    items += [("score", s, list(s.prefix_ids)) for s in backend.scores]
    outputs = [list(h.result().output_ids) for _, h in backend.generations]
    level: list[int] = []
    for i, (_, _, prompt) in enumerate(items):
        depth = 0
        for j, ((_, _, earlier), output) in enumerate(zip(items[:i], outputs, strict=False)):
            n = len(earlier)
            if output and len(prompt) > n and prompt[:n] == earlier and prompt[n] == output[0]:
                depth = max(depth, level[j] + 1)
        level.append(depth)
    grouped: dict[int, list] = defaultdict(list)
    for (kind, item, _), depth in zip(items, level, strict=True):
        grouped[depth].append((kind, item))
    return [grouped[d] for d in sorted(grouped)]


def run_independent(backend: LocalBackend) -> tuple[float, dict]:
    """The same prompts as plain requests: no hints, no pins, a prefill request per choice."""
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=60_000)) as engine:
        start = time.perf_counter()
        for batch in rounds(backend):
            requests = []
            for kind, item in batch:
                if kind == "gen":
                    requests.append(
                        GenerateRequest(input_ids=item.input_ids, sampling=item.sampling)
                    )
                else:
                    requests += [
                        GenerateRequest(
                            input_ids=item.prefix_ids + c,
                            sampling=SamplingParams(
                                max_new_tokens=0,
                                prompt_logprobs=True,
                                logprob_start_len=len(item.prefix_ids),
                            ),
                        )
                        for c in item.continuation_ids
                    ]
            engine.generate(requests)
        return time.perf_counter() - start, engine.stats()


def run_hf(hf, backend: LocalBackend) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for request, _ in backend.generations:
            p = request.sampling
            hf.generate(
                torch.tensor([request.input_ids]),
                max_new_tokens=p.max_new_tokens,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=2,
            )
        for result in backend.scores:
            for cont in result.continuation_ids:
                hf(torch.tensor([result.prefix_ids + cont]))
    return time.perf_counter() - start


def part1(skip_hf: bool, scale: dict[str, int]) -> None:
    hf = None
    if not skip_hf:
        from transformers import AutoModelForCausalLM

        from runtime.model.registry import resolve_model

        hf = AutoModelForCausalLM.from_pretrained(resolve_model(MODEL), dtype=torch.float32).eval()
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=1024)) as probe:
        tokenizer = probe.tokenizer
    print(
        "\n| workload | engine | wall s | vs transformers | prefill computed | unique prompt "
        "tokens | lower bound | hit rate |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (program, batch) in workloads(tokenizer, scale).items():
        wall, stats, backend = run_flowlang(program, batch)
        report = backend.prompt_report()
        ind_wall, ind_stats = run_independent(backend)
        hf_wall = run_hf(hf, backend) if hf is not None else None

        label = f"{name} ({len(batch)} runs)"
        for engine_name, w, s in (
            ("flowlang (graph-aware)", wall, stats),
            ("independent requests (fcfs, no hints)", ind_wall, ind_stats),
        ):
            ratio = f"{hf_wall / w:.1f}x" if hf_wall else "-"
            print(
                f"| {label} | {engine_name} | {w:.1f} | {ratio} | "
                f"{s['prefill_tokens_total']:,} | {report['unique_prompt_tokens']:,} | "
                f"{report['lower_bound']:,} | {s['cache_hit_rate']:.1%} |"
            )
        if hf_wall is not None:
            print(
                f"| {label} | transformers generate | {hf_wall:.1f} | 1.0x | "
                f"{report['prompt_tokens']:,} | {report['unique_prompt_tokens']:,} | "
                f"{report['lower_bound']:,} | 0.0% |"
            )


def part2(num_users: int) -> None:
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=1024)) as probe:
        inputs = support_agent.make_inputs(probe.tokenizer, "bench")
    inputs = type(inputs)(inputs.system_prompt, inputs.fewshot, inputs.users[:num_users])
    batch = support_agent.batch_args(inputs)
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=100_000, record_trace=True)) as engine:
        support_agent.support_agent.run_batch(batch, backend=LocalBackend(engine), progress=False)
        full = working_set(engine.cache_trace())
    capacity = full // 4
    print(
        f"\nW1 {num_users} users x 3 turns; working set {full:,} tokens; KV pool {capacity:,} "
        f"slots (25%)\n"
    )
    print("| eviction | where | token hit rate | prefill computed | evicted | wall s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    traces = {}
    for policy in ("lru", "graph"):
        config = EngineConfig(
            model=MODEL, max_kv_tokens=capacity, eviction_policy=policy, record_trace=True
        )
        with Engine(config) as engine:
            start = time.perf_counter()
            states = support_agent.support_agent.run_batch(
                batch, backend=LocalBackend(engine), progress=False
            )
            wall = time.perf_counter() - start
            assert all(hasattr(s, "text") for s in states), states
            stats = engine.stats()
            traces[policy] = engine.cache_trace()
        print(
            f"| {policy} | engine | {stats['cache_hit_rate']:.1%} | "
            f"{stats['prefill_tokens_total']:,} | {stats['evicted_tokens_total']:,} | "
            f"{wall:.1f} |"
        )
    for policy in ("lru", "belady"):
        result = replay(traces["lru"], capacity, policy)
        label = "offline optimum (farthest next use)" if policy == "belady" else policy
        print(
            f"| {label} | replay of the lru run's trace | {result.hit_rate:.1%} | "
            f"{result.computed_tokens:,} | {result.evicted_tokens:,} | - |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-eviction", action="store_true")
    parser.add_argument("--skip-programs", action="store_true")
    parser.add_argument("--eviction-users", type=int, default=32)
    parser.add_argument("--w1", type=int, default=8)
    parser.add_argument("--w2", type=int, default=16)
    parser.add_argument("--w3", type=int, default=2)
    parser.add_argument("--w4", type=int, default=8)
    parser.add_argument("--w6", type=int, default=8)
    args = parser.parse_args()
    if not args.skip_programs:
        part1(
            args.skip_hf,
            {"W1": args.w1, "W2": args.w2, "W3": args.w3, "W4": args.w4, "W6": args.w6},
        )
    if not args.skip_eviction:
        part2(args.eviction_users)


if __name__ == "__main__":
    main()
