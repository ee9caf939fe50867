"""Hierarchical KV tiers: what host memory (L2) and a disk directory (L3) below the device pool
(L1) save when the pool is too small for a multi-turn workload.

    python examples/benchmarks/tier_bench.py [--quick] [--model M] [--workloads W1,W6]
        [--shares 0.25,0.5] [--configs a,b,c,d] [--orders rounds,interleaved]
        [--policies lru,graph] [--w1-users 64] [--w6-convs 32] [--repeats 1]
    python examples/benchmarks/tier_bench.py --copy-rates [--model M]   # the copies alone

W1 (support agent) and W6 (multi-turn chat) run through their programs (eviction_cells.py,
arrivals.py) with the L1 pool at each share of the workload's working set, under each eviction
policy, with these tier configurations:
  a  no lower tier (evicted KV is recomputed: the engine without tiers);
  b  L2 only, large enough for the whole working set (nothing falls out of it);
  c  L2 + L3 (a fresh temporary directory);
  d  L3 only after a restart: a first run on an empty directory D closes (and so persists its
     cache to D), then the measured run is a fresh engine on D with no L2; it starts warm, so
     it may compute less than the bound;
  e  (not run by default) L2 for a quarter of the working set + L3: L2 spills to disk and the
     prefetch thread brings chunks back. In c nothing reaches L3 (L2 holds everything) and in
     d there is no L2 to prefetch into, so e is the configuration where L2 and L3 both serve loads.
Orders: rounds (every user's turn t, then turn t+1) and interleaved, where every continuation
tells its think time (`GraphHints.next_turn_after_s`), so the disk prefetch has declared
returns to act on. Greedy decoding and the reference attention: every run's outputs must equal
the unconstrained run's (asserted; tiers never change results).

Columns:
  computed     prompt tokens computed (prefill_tokens_total) and ÷ the unconstrained run's, the
               lower bound (a pool with room for everything, `unconstrained` rows);
  from L2/L3   prompt tokens loaded from host memory / from disk instead of computed;
  wall s       median over --repeats, and ÷ the unconstrained run's (the target);
  TTFT         p50 / p90 time to first token of returning turns (turn >= 1, counted per
               program run: the requests whose earlier turns may have been evicted), in ms,
               from submission (its wave's release: queueing behind the wave included);
  load tok/s   tokens loaded ÷ seconds the admission path spent loading (the step waited);
  recompute tok/s  tokens computed ÷ wall s (a coarse rate: wall includes decoding), so load
               beats recompute by the ratio of the two;
  waits        admission passes in which a request waited for its chunk files (read on the
               prefetch thread: the loop thread never reads a file) and the prefetch thread's
               seconds of reading. Copies from host memory are not counted: on CPU they run
               on the same cores whenever they happen (on a GPU they would go to a side stream).
Below the table, the warm restart: W1's first round (turn-0 requests) on an empty disk
directory vs on the directory a full earlier run closed on (config d's two runs): prompt
tokens those requests computed, and the ratio (goal < 10%).

Counters other than wall, TTFT and the rates are deterministic except the L2/L3 split in e
(the prefetch thread races admission). The default model is the real one; `--quick` runs a
tiny random-weight model with the real tokenizer (eviction_cells.TINY_MODEL), 16 W1 users and
8 W6 conversations, pools at 50%: W1's pool must hold its pinned system + few-shot prefix
(2,073 tokens) next to a user with retrieved notes (~2,300), which 8 users do not at 50%.
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

import eviction_cells
from arrivals import PacedBackend, interleaved_arrivals, think_hints, waves_of
from eviction_cells import WAVE_SIZE, CellResult, Workload

from flowlang.backends.local import LocalBackend
from runtime.cache.replay import working_set
from runtime.engine_tools import set_eviction_clock
from runtime.protocol import GenerateRequest, GenerateResult

CONFIGS = {"a": "none", "b": "L2", "c": "L2+L3", "d": "L3 restart", "e": "small L2+L3"}
UNCONSTRAINED_SLOTS = 400_000  # as eviction_cells.unbounded_run (lazily resident on CPU)
HOST_MARGIN = 1.5  # L2 sized at the working set x this: partial chunks and rounding fit too
SMALL_HOST_SHARE = 0.25  # e: L2 for this share of the working set, so L2 spills to L3
THINK_JITTER = eviction_cells.THINK_JITTER  # interleaved: think times of 0.5-1.5 cycles
RESTART_GOAL = 0.10  # warm restart: the first round computes under 10% of the cold one's
QUICK = {"model": eviction_cells.TINY_MODEL, "w1_users": 16, "w6_convs": 8, "shares": "0.5"}
DEFAULTS = {"model": "smollm2-135m-instruct", "w1_users": 64, "w6_convs": 32, "shares": "0.25,0.5"}


@dataclass(frozen=True)
class TierRun:
    cell: CellResult
    stats: dict[str, float]
    turns: list[tuple[int, GenerateResult]]  # every generate request: (turn index, result)
    kv_bytes_per_token: int


class TurnRecorder(PacedBackend):
    """A PacedBackend that keeps each generate request's turn (its program run's request count
    so far: a run's turns come in order) and its handle, to read TTFTs after the run."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._requests: list[tuple[int, object]] = []
        self._turns_so_far: Counter[str | None] = Counter()
        self._lock = threading.Lock()

    def generate(self, request: GenerateRequest):
        pending = super().generate(request)
        with self._lock:
            run = request.hints.program_id
            self._requests.append((self._turns_so_far[run], pending))
            self._turns_so_far[run] += 1
        return pending

    def results(self) -> list[tuple[int, GenerateResult]]:
        return [(turn, pending.result()) for turn, pending in self._requests]


def run_tiers(
    workload: Workload,
    order: str,
    model: str,
    tokenizer,
    capacity: int,
    policy: str,
    settings: dict,
) -> TierRun:
    """eviction_cells.run_cell with engine `settings` (the tiers), every request's result kept
    and the engine's stats read before it closes; interleaved always tells think times."""
    with eviction_cells.cell_engine(
        model, tokenizer, capacity, policy, engine_settings=settings
    ) as engine:
        local = LocalBackend(engine)
        graphs = [workload.program.compile(backend=local, **args) for args in workload.batch]
        firsts = [g.first_prompt() for g in graphs]
        wave_times = hints = None
        if order == "interleaved":
            arrivals = interleaved_arrivals(
                workload.num_users, workload.num_turns, WAVE_SIZE, think_jitter=THINK_JITTER
            )
            schedule = waves_of(arrivals, WAVE_SIZE)  # the very arrivals the hints are from
            wave_times, hints = think_hints(schedule, arrivals)
        else:
            schedule = eviction_cells.schedule_of(workload, order, THINK_JITTER)
        backend = TurnRecorder(local, firsts, schedule, wave_times, hints)
        if hints is not None:
            set_eviction_clock(engine, backend.clock)
        start = time.perf_counter()
        states = workload.program.run_batch(
            workload.batch, backend=backend, progress=False, sampling=eviction_cells.REPLY_SAMPLING
        )
        cell = eviction_cells.cell_result(engine, states, time.perf_counter() - start)
        pool = engine.runner.pool
        kv_bytes = 2 * pool.num_layers * pool.k[0][0].numel() * pool.dtype.itemsize
        return TierRun(cell, engine.stats(), backend.results(), kv_bytes)


def median_by_wall(items: list, run_of=lambda item: item):
    """The item whose run has the median wall time (the lower one of an even count): its
    counters go with it."""
    return sorted(items, key=lambda item: run_of(item).cell.wall_s)[(len(items) - 1) // 2]


def tier_settings(config: str, host_gib: float, disk_dir: str | None) -> dict:
    small_gib = host_gib * SMALL_HOST_SHARE / HOST_MARGIN
    return {
        "a": {},
        "b": {"host_kv_gb": host_gib},
        "c": {"host_kv_gb": host_gib, "disk_kv_dir": disk_dir},
        "d": {"disk_kv_dir": disk_dir},
        "e": {"host_kv_gb": small_gib, "disk_kv_dir": disk_dir},
    }[config]


def measure(config: str, repeats: int, host_gib: float, run) -> tuple[TierRun, TierRun | None]:
    """The median of `repeats` runs of `config` (`run(settings)` runs the cell), and for d the
    cold run on the empty directory that preceded it."""
    pairs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="tier-bench-") as disk_dir:
            settings = tier_settings(config, host_gib, disk_dir)
            cold = run(settings) if config == "d" else None  # its close() persists to disk_dir
            pairs.append((run(settings), cold))
    return median_by_wall(pairs, lambda pair: pair[0])


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (`values` not empty)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def first_round_computed(run: TierRun) -> int:
    """Prompt tokens the turn-0 requests computed (neither cached nor loaded at admission)."""
    return sum(r.prompt_tokens - r.cached_tokens for turn, r in run.turns if turn == 0)


def row(run: TierRun, reference: TierRun) -> str:
    """The measured columns of one run (see the module docstring)."""
    s, cell = run.stats, run.cell
    computed, bound = cell.prefill_computed, reference.cell.prefill_computed
    from_host = s.get("kv_loaded_host_tokens_total", 0)
    from_disk = s.get("kv_loaded_disk_tokens_total", 0)
    load_s = s.get("kv_load_seconds_total", 0.0)
    prefetch_s = s.get("kv_prefetch_seconds_total", 0.0)  # no tiers (config a): none read
    ttfts = [r.ttft_s * 1e3 for turn, r in run.turns if turn >= 1 and r.ttft_s is not None]
    columns = [
        f"{computed:,} ({computed / bound:.2f}x)",
        f"{from_host:,}",
        f"{from_disk:,}",
        f"{cell.wall_s:.1f} ({cell.wall_s / reference.cell.wall_s:.2f}x)",
        f"{percentile(ttfts, 0.5):.0f} / {percentile(ttfts, 0.9):.0f}" if ttfts else "-",
        f"{(from_host + from_disk) / load_s:,.0f}" if load_s else "-",
        f"{computed / cell.wall_s:,.0f}",
        f"{s['disk_waits_total']:,} / {prefetch_s:.2f} s",
    ]
    return " | ".join(columns) + " |"


def anomalies(run: TierRun) -> list[str]:
    """Disk-tier trouble a clean benchmark run should not have."""
    keys = ("kv_disk_bad_files_total", "kv_disk_write_errors_total", "kv_disk_writes_inline_total")
    return [f"{key} = {run.stats[key]}" for key in keys if run.stats.get(key)]


def bench(args: argparse.Namespace) -> None:
    tokenizer = eviction_cells.load_bench_tokenizer()
    header = (
        "| workload | order | pool | policy | tiers | computed (÷ bound) | from L2 | from L3 | "
        "wall s (÷ unconstrained) | TTFT p50 / p90 ms, turns ≥ 1 | load tok/s | "
        "recompute tok/s | waits |"
    )
    print(f"\n{header}\n| --- | --- | --- | --- | --- |" + " ---: |" * 8, flush=True)
    restarts, notes = [], []
    for workload in eviction_cells.workloads(tokenizer, args.w1_users, args.w6_convs):
        if not any(workload.name.startswith(w) for w in args.workloads):
            continue
        for order in args.orders:
            run = functools.partial(run_tiers, workload, order, args.model, tokenizer)
            reference = median_by_wall(
                [run(UNCONSTRAINED_SLOTS, "lru", {}) for _ in range(args.repeats)]
            )
            assert reference.cell.evicted == 0, "the unconstrained pool evicted: raise its size"
            full = working_set(reference.cell.trace)
            host_gib = full * reference.kv_bytes_per_token * HOST_MARGIN / 2**30
            prefix = f"| {workload.name} | {order} |"
            print(
                f"{prefix} unconstrained | lru | - (L2 in b, c: {host_gib:.3g} GiB) | "
                f"{row(reference, reference)}",
                flush=True,
            )
            for share in args.shares:
                capacity = int(full * share)
                for policy in args.policies:
                    for config in args.configs:
                        cell = functools.partial(run, capacity, policy)
                        measured, cold = measure(config, args.repeats, host_gib, cell)
                        for r in (measured, cold) if cold is not None else (measured,):
                            where = f"{workload.name} {order} {capacity} {policy} {config}"
                            assert r.cell.token_ids == reference.cell.token_ids, where
                            notes += [f"{where}: {a}" for a in anomalies(r)]
                        if cold is not None and workload.name.startswith("W1"):
                            restarts.append((order, share, capacity, policy, cold, measured))
                        print(
                            f"{prefix} {share:.0%} of {full:,} = {capacity:,} | {policy} | "
                            f"{config} {CONFIGS[config]} | {row(measured, reference)}",
                            flush=True,
                        )
    print_restarts(restarts)
    print("\nevery run's outputs equal the unconstrained run's")
    for note in notes:
        print(f"NOTE {note}")


def print_restarts(restarts: list[tuple]) -> None:
    """Config d's W1 runs: the first round on an empty directory vs after a closed full run."""
    if not restarts:
        print("\nwarm restart: not measured (it needs W1 and config d)")
        return
    print("\nwarm restart, W1 first round (turn-0 requests): prompt tokens computed\n")
    print("| order | pool | policy | cold (empty dir) | warm (after a closed run) | ratio |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for order, share, capacity, policy, cold, warm in restarts:
        cold_n, warm_n = first_round_computed(cold), first_round_computed(warm)
        ratio = warm_n / cold_n if cold_n else float("nan")
        verdict = "ok" if ratio < RESTART_GOAL else f"over the {RESTART_GOAL:.0%} goal"
        print(
            f"| {order} | {share:.0%} = {capacity:,} | {policy} | {cold_n:,} | {warm_n:,} | "
            f"{ratio:.1%} ({verdict}) |"
        )


def copy_rates(model: str, num_tokens: int = 16_384, repeats: int = 3) -> None:
    """The copies alone, for `model`'s KV layout (no forward pass): demote `num_tokens` from
    the pool to host memory (the tree's eviction), load them back (admission), and the
    model's prefill rate on one 512-token prompt, the cost a load replaces. Medians."""
    import torch

    from runtime.cache.tiers import KVTiers, TierExtent

    with eviction_cells.cell_engine(model, None, num_tokens + 1024, "lru") as engine:
        pool = engine.runner.pool  # (the engine has no tiers: the copies get their own)
        prompt = list(range(100, 612))
        sampling = {"max_new_tokens": 1, "temperature": 0.0}
        prefill_s = []
        for _ in range(repeats):
            engine.flush_cache()
            start = time.perf_counter()
            engine.generate(GenerateRequest(input_ids=prompt, sampling=sampling))
            prefill_s.append(time.perf_counter() - start)
        from runtime.cache.chunks import TierLayout

        layout = TierLayout(
            model, pool.num_layers, pool.k[0].shape[1], pool.k[0].shape[2], pool.dtype, 1
        )
        tiers = KVTiers(pool, layout, host_bytes=(num_tokens // 16 + 8) * layout.chunk_nbytes)
        ids = list(range(num_tokens))
        slots = torch.arange(num_tokens)
        names = tuple(tiers.names(None, ids, num_tokens))
        demote_s, load_s = [], []
        for _ in range(repeats):
            tiers = KVTiers(pool, layout, host_bytes=(num_tokens // 16 + 8) * layout.chunk_nbytes)
            start = time.perf_counter()
            tiers.demote(None, tuple(ids), 0, slots)
            demote_s.append(time.perf_counter() - start)
            extent = TierExtent(0, 0, names, (True,) * len(names), layout.chunk_tokens)
            start = time.perf_counter()
            assert tiers.load(extent, slots) == num_tokens
            load_s.append(time.perf_counter() - start)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    kib = layout.chunk_nbytes / layout.chunk_tokens / 1024
    print(
        f"\ncopies alone: {model}, {pool.dtype}, {kib:.0f} KiB of KV per token, "
        f"{num_tokens:,} tokens, median of {repeats}\n"
    )
    print("| what | tok/s | GB/s |\n| --- | ---: | ---: |")
    for what, tokens, seconds in (
        ("demote (pool to host memory)", num_tokens, median(demote_s)),
        ("load (host memory to pool)", num_tokens, median(load_s)),
        ("prefill, 512-token prompt (what a load replaces)", len(prompt), median(prefill_s)),
    ):
        rate = tokens / seconds
        print(f"| {what} | {rate:,.0f} | {rate * kib * 1024 / 1e9:.2f} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"default {DEFAULTS['model']}")
    parser.add_argument("--workloads", default="W1,W6")
    parser.add_argument("--shares", help="L1 pool sizes as shares of the working set")
    parser.add_argument("--configs", default="a,b,c,d", help="tier configurations: a,b,c,d")
    parser.add_argument("--orders", default="rounds,interleaved")
    parser.add_argument("--policies", default="lru,graph")
    parser.add_argument("--w1-users", type=int, help="W1 users (3 turns)")
    parser.add_argument("--w6-convs", type=int, help="W6 conversations (4 turns)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell (median wall)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: " + str(QUICK))
    parser.add_argument(
        "--copy-rates", action="store_true", help="only the copy rates (no workload)"
    )
    args = parser.parse_args()
    for key, value in {**DEFAULTS, **(QUICK if args.quick else {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.shares = [float(s) for s in args.shares.split(",")]
    for key in ("workloads", "configs", "orders", "policies"):
        setattr(args, key, getattr(args, key).split(","))
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {sorted(CONFIGS)}")
    return args


def main() -> None:
    args = parse_args()
    print("python " + shlex.join(sys.argv))
    print(
        f"\nmodel {args.model}; {eviction_cells.ATTENTION} attention, greedy, replies of fixed "
        f"length (ignore_eos); W1 {args.w1_users} users, W6 {args.w6_convs} conversations; "
        f"L1 pools {', '.join(f'{s:.0%}' for s in args.shares)} of the working set; tiers "
        f"{', '.join(f'{c} ({CONFIGS[c]})' for c in args.configs)}; L2 = working set x "
        f"{HOST_MARGIN} x KV bytes per token; orders {', '.join(args.orders)} (interleaved: "
        f"think times told, jitter {THINK_JITTER}); policies {', '.join(args.policies)}; wall: "
        f"median of {args.repeats}"
    )
    if args.copy_rates:
        copy_rates(args.model)
        return
    bench(args)


if __name__ == "__main__":
    main()
