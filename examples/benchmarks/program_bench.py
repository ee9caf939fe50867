"""flowlang programs (W1-W4, W6) on the default model vs the same prompts as independent
requests vs transformers, and graph-aware eviction vs LRU vs the offline optimum.

    python examples/benchmarks/program_bench.py [--skip-hf] [--skip-eviction] [--skip-programs]
        [--eviction-only W1|W6|run_batch] [--arrivals rounds,interleaved] [--think-jitter 0.5]

Part 1, per workload, one run each, greedy, fp32:
  flowlang      run_batch on the engine: graph hints, fork pins, batch pins, trie scoring;
  independent   the very requests flowlang sent, replayed as plain requests without hints,
                pins or scoring (a select's choices become one prefill request each), fcfs,
                request k of every instance submitted together (the same dependencies);
  transformers  the same generation prompts one by one with `generate`, choices scored by a
                forward pass each.
Part 2 (issue 13): W1 and W6 through programs in two arrival orders (rounds; interleaved with
think time: arrivals.py), KV pools at 25% and 50% of the working set: prefill computed and token
hit rate under lru, slru, lfu, graph, graph with clients that tell their think times
(`next_turn_after_s`; interleaved only) and the oracle (farthest recorded next use, oracle.py),
on a tiny random-weight model with the real tokenizer unless --eviction-model says otherwise.
Part 3 (issue 32): the run_batch family (batch_cells.py): conversations with private contexts,
no think time, pools at 25-60% of the working set, page sizes 1 and 16: prefill computed under
lru, slru, graph and the engine oracle against the offline optimum (Belady replay of the lru
run's access order). --eviction-only skips part 1.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import batch_cells
import eviction_cells
import torch

from flowlang.backends.local import LocalBackend
from programs import fewshot_choice, judge, multi_turn_chat, support_agent, tree_of_thought
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


EVICTION_POLICIES = ("lru", "slru", "lfu", "graph", "graph told", "oracle")


def part2(
    num_w1_users: int,
    num_w6_convs: int,
    model: str,
    only: str | None,
    think_jitter: float,
    orders: list[str],
) -> None:
    """Prefill computed and token hit rate per policy, for W1 and W6, pools at 25% and 50% of
    the working set, in rounds and interleaved (eviction_cells.py); the oracle is driven by
    the trace of the same cell's lru run."""
    tokenizer = eviction_cells.load_bench_tokenizer()
    print(
        f"\nmodel {model}; replies of fixed length (ignore_eos, greedy); interleaved think "
        f"time 1 +- {think_jitter} cycles; one run per cell\n"
    )
    header = " | ".join(f"{p} computed / hit" for p in EVICTION_POLICIES)
    print(f"| workload | arrivals | pool | {header} | graph vs oracle | graph told vs oracle |")
    print("| --- | --- | --- |" + " ---: |" * (len(EVICTION_POLICIES) + 2))
    for workload in eviction_cells.workloads(tokenizer, num_w1_users, num_w6_convs):
        if only is not None and not workload.name.startswith(only):
            continue
        for order in orders:
            unbounded, full = eviction_cells.unbounded_run(
                workload, order, model, tokenizer, think_jitter
            )
            for share in (0.25, 0.5):
                capacity = int(full * share)
                cells: dict[str, eviction_cells.CellResult | None] = {}
                for column in EVICTION_POLICIES:
                    policy, told = column.removesuffix(" told"), column.endswith(" told")
                    if told and order != "interleaved":
                        cells[column] = None  # in rounds every user thinks alike: nothing to tell
                        continue
                    future = cells["lru"].trace if policy == "oracle" else None
                    cell = eviction_cells.run_cell(
                        workload,
                        order,
                        model,
                        tokenizer,
                        capacity,
                        policy,
                        future,
                        think_jitter,
                        told,
                    )
                    assert cell.token_ids == unbounded.token_ids, f"{column} changed outputs"
                    cells[column] = cell
                oracle = cells["oracle"]
                gaps = " | ".join(
                    "-"
                    if cell is None
                    else f"{cell.prefill_computed / oracle.prefill_computed - 1:+.1%} computed, "
                    f"{100 * (cell.hit_rate - oracle.hit_rate):+.2f} pt"
                    for cell in (cells["graph"], cells["graph told"])
                )
                row = " | ".join(
                    "-" if c is None else f"{c.prefill_computed:,} / {c.hit_rate:.1%}"
                    for c in cells.values()
                )
                print(
                    f"| {workload.name} | {order} | {share:.0%} of {full:,} = {capacity:,} | "
                    f"{row} | {gaps} |",
                    flush=True,
                )


BATCH_POLICIES = ("lru", "slru", "graph", "oracle")


def part3(
    model: str,
    shapes=batch_cells.SHAPES,
    shares=batch_cells.SHARES,
    pages=batch_cells.PAGE_SIZES,
    policies=BATCH_POLICIES,
) -> None:
    """The run_batch family (issue 32): prefill computed per policy against the offline
    optimum (Belady on the lru run's access order); every cell asserts equal outputs."""
    tokenizer = eviction_cells.load_bench_tokenizer()
    print(
        f"\nmodel {model}; run_batch, no think time; replies of fixed length (ignore_eos, "
        "greedy); one run per cell; optimum = Belady replay of the lru run's access order\n"
    )
    policies = ("lru", *(p for p in policies if p != "lru"))  # the optimum replays lru's run
    header = " | ".join(f"{p} computed" for p in policies)
    print(
        f"| batch | page | pool | {header} | optimum | graph ÷ optimum | graph ÷ lru | "
        "wall s lru / graph |"
    )
    print("| --- | ---: | --- |" + " ---: |" * (len(policies) + 4))
    worst = 0.0
    for shape in shapes:
        batch = batch_cells.make_batch(tokenizer, shape)
        unbounded, full = batch_cells.unbounded_run(batch, tokenizer, model)
        for page_size in pages:
            for share in shares:
                capacity = int(full * share) // page_size * page_size
                cells = {}
                for policy in policies:
                    future = cells["lru"].trace if policy == "oracle" else None
                    cell = batch_cells.run_cell(
                        batch, tokenizer, capacity, policy, page_size, future, model
                    )
                    assert cell.token_ids == unbounded.token_ids, f"{policy} changed outputs"
                    cells[policy] = cell
                optimum = batch_cells.offline_optimum(cells["lru"], capacity)
                graph, lru = cells["graph"], cells["lru"]
                worst = max(worst, graph.prefill_computed / optimum)
                row = " | ".join(f"{c.prefill_computed:,}" for c in cells.values())
                print(
                    f"| {shape.name} | {page_size} | {share:.0%} of {full:,} = {capacity:,} | "
                    f"{row} | {optimum:,} | {graph.prefill_computed / optimum:.2f}x | "
                    f"{graph.prefill_computed / lru.prefill_computed:.2f}x | "
                    f"{lru.wall_s:.1f} / {graph.wall_s:.1f} |",
                    flush=True,
                )
    print(f"\nworst graph ÷ optimum: {worst:.2f}x")


def diagnose(shape_index: int = 0, share: float = 0.35) -> None:
    """Issue 32's diagnosis on one cell: the state at the first eviction under each policy."""
    tokenizer = eviction_cells.load_bench_tokenizer()
    batch = batch_cells.make_batch(tokenizer, batch_cells.SHAPES[shape_index])
    _, full = batch_cells.unbounded_run(batch, tokenizer)
    capacity = int(full * share)
    print(f"\n{batch_cells.SHAPES[shape_index].name}, pool {capacity:,}: at the first eviction\n")
    print("| policy | running | locked tokens | evictable tokens | of them read by waiting |")
    print("| --- | ---: | ---: | ---: | ---: |")
    lru = batch_cells.run_cell(batch, tokenizer, capacity, "lru")
    for policy in ("lru", "oracle", "graph"):
        state = batch_cells.first_eviction(batch, tokenizer, capacity, policy, lru.trace)
        print(
            f"| {policy} | {state.running} | {state.locked_tokens:,} | "
            f"{state.evictable_tokens:,} | {state.waiting_reads:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-eviction", action="store_true")
    parser.add_argument("--skip-programs", action="store_true")
    parser.add_argument("--eviction-w1", type=int, default=64, help="W1 users (3 turns)")
    parser.add_argument("--eviction-w6", type=int, default=32, help="W6 conversations")
    parser.add_argument("--eviction-model", default=eviction_cells.TINY_MODEL)
    parser.add_argument(
        "--eviction-only",
        choices=("W1", "W6", "run_batch"),
        help="one workload's rows; run_batch: the run_batch family alone (batch_cells.py)",
    )
    parser.add_argument("--arrivals", default="rounds,interleaved", help="orders, comma separated")
    parser.add_argument(
        "--think-jitter", type=float, default=eviction_cells.THINK_JITTER, help="0: predictable"
    )
    parser.add_argument(
        "--batch-shapes", default=None, help="run_batch family: shape indices, comma separated"
    )
    parser.add_argument("--batch-shares", default=None, help="run_batch family: pool shares")
    parser.add_argument("--batch-pages", default=None, help="run_batch family: page sizes")
    parser.add_argument(
        "--batch-policies", default=",".join(BATCH_POLICIES), help="run_batch family: policies"
    )
    parser.add_argument(
        "--batch-diagnose",
        action="store_true",
        help="run_batch family: the state at the first eviction, lru and graph (first cell)",
    )
    parser.add_argument("--w1", type=int, default=8)
    parser.add_argument("--w2", type=int, default=16)
    parser.add_argument("--w3", type=int, default=2)
    parser.add_argument("--w4", type=int, default=8)
    parser.add_argument("--w6", type=int, default=8)
    args = parser.parse_args()
    if args.batch_diagnose:
        diagnose()
        return
    if not args.skip_programs and args.eviction_only is None:
        part1(
            args.skip_hf,
            {"W1": args.w1, "W2": args.w2, "W3": args.w3, "W4": args.w4, "W6": args.w6},
        )
    if args.skip_eviction:
        return
    if args.eviction_only != "run_batch":
        part2(
            args.eviction_w1,
            args.eviction_w6,
            args.eviction_model,
            args.eviction_only,
            args.think_jitter,
            args.arrivals.split(","),
        )
    if args.eviction_only in (None, "run_batch"):
        shapes = batch_cells.SHAPES
        if args.batch_shapes:
            shapes = tuple(shapes[int(i)] for i in args.batch_shapes.split(","))
        shares = tuple(map(float, args.batch_shares.split(","))) if args.batch_shares else None
        pages = tuple(map(int, args.batch_pages.split(","))) if args.batch_pages else None
        part3(
            args.eviction_model,
            shapes,
            shares or batch_cells.SHARES,
            pages or batch_cells.PAGE_SIZES,
            tuple(args.batch_policies.split(",")),
        )


if __name__ == "__main__":
    main()
