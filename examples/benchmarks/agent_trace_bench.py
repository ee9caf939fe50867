"""Agent-trace cells (W7, issue 52): a drawn batch of agents through `run_batch` under each KV
setting, a fresh engine per row; one table per cell.

Rows: an unbounded pool (its prefill computed is the exact bound: the same batch, nothing
evicted; it also measures the working set the other pools are sized from), then, with the pool
at the cell's share of that working set (ROWS): lru; graph eviction request by request (no
program gate); SGLang-style priority hints (each program's requests carry its start order as
priority, for priority scheduling and eviction); Continuum-style TTL pins at tool calls (lru,
`tool_pin_ttl_s`); the program gate with graph eviction (runtime/scheduler/programs.py); and
lru with a host tier as large as the working set. Columns: prefill tokens computed and their ratio
to the exact bound, mean / p90 / p99 program completion seconds (from the batch's start), the
makespan, throughput in programs per second, requests the engine refused as busy and the
bench resubmitted (pins and running prefixes held the pool), and whether every program's
output equals the unbounded run's. The header also gives the analytic bound (the union of
every prompt minus the KV computed while decoding), which the unbounded run meets at page
size 1.

One run per row on a shared machine: the counters are exact, the times indicative. With
`--repeats N` each row runs N times, interleaved, and the table shows medians and each row's
ratios to lru's run of the same repeat (repeat_rows.py).

    python examples/benchmarks/agent_trace_bench.py --tiny --cells 1
    python examples/benchmarks/agent_trace_bench.py --cells 1 --pool-fraction 0.35 --page-size 1
    python examples/benchmarks/agent_trace_bench.py --tiny --cells 4 --repeats 5 --rows lru \
        "programs (graph + gate)"
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from agent_traces import PRESETS, AgentBatch, agent_rounds, draw_batch, vary
from eviction_cells import TINY_MODEL, load_bench_tokenizer
from repeat_rows import interleaved, medians, print_ratios

from flowlang.backends.local import LocalBackend
from flowlang.program import no_priority
from programs.agent_trace import agent_trace
from runtime.cache.replay import working_set
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_tools import cache_trace
from runtime.model.arch import ModelArch
from runtime.model.loader import load_config
from runtime.model.random_weights import random_checkpoint
from runtime.model.registry import resolve_model

DEFAULT_MODEL = "smollm2-135m-instruct"
POOL_BYTES_CAP = 10 * 2**30  # pool + host tier per engine: two engines fit in 24 GB
UNBOUNDED_HEADROOM = 1.5  # the unbounded pool over the estimated working set
HOST_HEADROOM = 1.25  # the host tier over the measured working set
RETRY_AFTER_S = 0.05  # a refused request is resubmitted after this
# --stats: after each row, what the scheduler did (to stderr)
STATS_SHOWN = ("programs_entered_total", "programs_entered_priced_total",
               "program_entries_deferred_total", "program_kept_lost_tokens_total",
               "program_returns_recomputed_tokens_total",
               "program_headroom_tokens", "program_growth_tokens", "programs_displaced_total",
               "admissions_held_total", "retractions_total",
               "evicted_tokens_total", "steps_total")  # fmt: skip


class Retrying:
    """A backend mixin that resubmits a request the engine refused as busy ("retry later": pins
    and running prefixes hold the whole pool), as a client that honours the answer does; the
    table counts the retries (greedy, so a retried request gives the same output)."""

    retries = 0
    _retries_lock = threading.Lock()

    def generate(self, request):
        return _RetryingHandle(self, request)

    def submit(self, request):
        return super().generate(request)

    def retried(self) -> None:
        with self._retries_lock:
            self.retries += 1
        time.sleep(RETRY_AFTER_S)


class RetryingBackend(Retrying, LocalBackend):
    """The engine in this process, retried when busy."""


class _RetryingHandle:
    def __init__(self, backend: RetryingBackend, request) -> None:
        self.backend, self.request = backend, request
        self.handle, self.final = backend.submit(request), None

    def __iter__(self):
        while self.final is None:
            yield from self.handle
            result = self.handle.result()
            if result.finish_reason == "error" and result.error_kind == "busy":
                self.backend.retried()
                self.handle = self.backend.submit(self.request)
            else:
                self.final = result

    def result(self):
        for _ in self:  # whatever is left of the stream and its retries
            pass
        return self.final


class PriorityHints(RetryingBackend):
    """SGLang-style client hints: each program's requests carry a priority, the earlier a
    program started the higher (a client that wants programs finished in order), for the
    engine's priority scheduling and priority eviction."""

    def __init__(self, engine, record: bool = False) -> None:
        super().__init__(engine, record)
        self._rank: dict[str, int] = {}

    def submit(self, request):
        program = request.hints.program_id
        with self._retries_lock:
            rank = self._rank.setdefault(program, len(self._rank))
        hints = request.hints.model_copy(update={"priority": -rank})
        return super().submit(request.model_copy(update={"hints": hints}))


def shortest_first(args: dict) -> int:
    """SHORT_FIRST_ROW's run_batch priority: the pipeline declares each agent's size (its
    rounds and its subagents'), the fewest first."""
    return -agent_rounds(args["trace"])


@dataclass(frozen=True)
class RowResult:
    computed: int  # prefill tokens computed
    evicted: int
    completions_s: list[float]  # per program, from the batch's start (nan: it failed)
    outputs: list[tuple | None]  # per program: its tokens and its subagents' reports
    failures: list[str]  # the programs that failed (the engine refused a request)
    makespan_s: float
    working_set: int  # tokens, from the recorded trace (unbounded row only)
    analytic_bound: int  # prefill lower bound from the recorded requests (unbounded row only)
    kv_bytes_per_token: int
    retries: int  # requests the engine refused as busy, resubmitted
    # of `computed`, what branches back from their tools computed again of the paths they
    # paused at (the program gate's counter; 0 without it)
    returns_recomputed: int = 0


def make_engine(model: str, tokenizer, capacity: int, policy: str, batch, **settings) -> Engine:
    engine = Engine(
        EngineConfig(
            model=model,
            max_kv_tokens=capacity,
            eviction_policy=policy,
            page_size=batch.page_size,
            **settings,
        )
    )
    if engine.tokenizer is None:  # a random-weight model: lend it the real tokenizer
        engine.tokenizer = engine.intake.tokenizer = tokenizer
    return engine


def run_row(
    batch: AgentBatch,
    model: str,
    tokenizer,
    capacity: int,
    policy: str,
    backend_type: Callable[..., RetryingBackend] | None = None,
    show_stats: bool = False,
    priority: Callable[[dict], int] = no_priority,
    **settings,
):
    """The batch through agent_trace.run_batch (each instance's `priority` from its
    arguments) on a fresh `capacity`-slot engine."""
    with make_engine(model, tokenizer, capacity, policy, batch, **settings) as engine:
        recording = bool(settings.get("record_trace"))  # the unbounded row: bounds measured
        backend = (backend_type or RetryingBackend)(engine, record=recording)
        states, makespan_s = run_timed(batch, backend, priority)
        engine.check_integrity()
        stats = engine.stats()
        if show_stats:
            print(f"  [{policy} {settings}] " + ", ".join(
                f"{k.removesuffix('_total')} {int(stats[k]):,}" for k in STATS_SHOWN
            ), file=sys.stderr)  # fmt: skip
        trace = cache_trace(engine) if recording else []
        return RowResult(
            int(stats["prefill_tokens_total"]),
            int(stats["evicted_tokens_total"]),
            *program_results(states),
            makespan_s,
            working_set(trace) if trace else 0,
            backend.prompt_report()["lower_bound"] if recording else 0,
            engine.arch.kv_bytes_per_token(engine.config.dtype),
            backend.retries,
            int(stats["program_returns_recomputed_tokens_total"]),
        )


def run_timed(
    batch: AgentBatch, backend, priority: Callable[[dict], int] = no_priority
) -> tuple[list, float]:
    """Every agent of the batch through `backend` (each from its arrival): the states and the
    makespan (seconds from the batch's start)."""
    start = time.perf_counter()
    states = agent_trace.run_batch(
        batch.batch_args(),
        backend=backend,
        progress=False,
        max_workers=len(batch.agents),
        priority=priority,
    )
    return states, time.perf_counter() - start


def program_results(states: list) -> tuple[list, list, list]:
    """From run_batch's states: each program's completion seconds from its arrival (nan if it
    failed) and output (its tokens and its subagents' reports; None if it failed), and the
    failures."""
    completions, outputs, failures = [], [], []
    for state in states:
        if hasattr(state, "text"):  # a failure is an InstanceError
            completions.append(state["finished_s"] - state["arrived_s"])
            outputs.append((tuple(state.token_ids()), tuple(state.get("report") or ())))
        else:
            completions.append(math.nan)
            outputs.append(None)
            failures.append(str(state))
    return completions, outputs, failures


def completed(completions_s: list[float]) -> list[float]:
    """The completions of the programs that finished ([nan] if none did)."""
    return [c for c in completions_s if not math.isnan(c)] or [math.nan]


def short_p99(batch: AgentBatch, completions_s: list[float]) -> float:
    """p99 completion of the short programs: those with at most the median rounds (their own
    and their subagents', agent_rounds)."""
    median = statistics.median(map(agent_rounds, batch.agents))
    short = [
        c for a, c in zip(batch.agents, completions_s, strict=True) if agent_rounds(a) <= median
    ]
    return percentile(completed(short), 0.99)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# the rows besides the unbounded pool: name -> (eviction, settings); TTL_ROW's pin is the
# trace's time scale (86% of tool calls return within it), "{host}" the host tier's size
PROGRAMS_ROW, TTL_ROW = "programs (graph + gate)", "lru + ttl pin"
SHORT_FIRST_ROW = "programs + short first"
HOST_ROW, PROGRAMS_HOST_ROW = "lru + host tier", "programs + host tier"
ROWS = {
    "lru": ("lru", {}),
    "graph, requests": ("graph", {"program_admission": False}),
    "priority hints": ("priority", {"schedule_policy": "priority"}),
    TTL_ROW: ("lru", {}),
    PROGRAMS_ROW: ("graph", {}),
    SHORT_FIRST_ROW: ("graph", {}),
    HOST_ROW: ("lru", {}),
    PROGRAMS_HOST_ROW: ("graph", {}),
}


def run_cell(
    batch: AgentBatch,
    model: str,
    tokenizer,
    attention: str,
    rows_wanted: list[str],
    show_stats: bool = False,
    repeats: int = 1,
) -> dict[str, list[RowResult]]:
    """The unbounded run first (it sizes the others' pools; run once: its counters are the
    bound), then each of `rows_wanted` `repeats` times, interleaved (repeat_rows.py)."""
    capacity = math.ceil(batch.working_set_tokens() * UNBOUNDED_HEADROOM)
    check_memory(capacity * kv_bytes_per_token(model))  # before its minutes of running
    unbounded = run_row(batch, model, tokenizer, capacity, "lru", record_trace=True,
                        attention_backend=attention)  # fmt: skip
    rows: dict[str, list[RowResult]] = {"unbounded pool": [unbounded]}
    for _, name in interleaved(rows_wanted, repeats):
        ran = run_cell_rows(batch, model, tokenizer, unbounded, [name], attention, show_stats)
        rows.setdefault(name, []).append(ran[name])
    return rows


def run_cell_rows(
    batch: AgentBatch,
    model: str,
    tokenizer,
    unbounded: RowResult,
    rows_wanted: list[str],
    attention: str = "torch",
    show_stats: bool = False,
) -> dict[str, RowResult]:
    """Each of `rows_wanted` with the pool at the cell's share of the unbounded run's working
    set."""
    pool = batch.pool_tokens(unbounded.working_set)
    host_gib = unbounded.working_set * unbounded.kv_bytes_per_token * HOST_HEADROOM / 2**30
    # engines run one at a time: a row holds the pool, and the host tier if it has one
    host_rows = {HOST_ROW, PROGRAMS_HOST_ROW}.intersection(rows_wanted)
    check_memory(pool * unbounded.kv_bytes_per_token + (host_gib * 2**30 if host_rows else 0))
    host = {"host_kv_gb": host_gib}
    extra = {TTL_ROW: {"tool_pin_ttl_s": batch.time_scale}, HOST_ROW: host, PROGRAMS_HOST_ROW: host}
    rows = {}
    for name in rows_wanted:
        policy, settings = ROWS[name]
        settings = {"attention_backend": attention, **settings, **extra.get(name, {})}
        backend = PriorityHints if name == "priority hints" else RetryingBackend
        priority = shortest_first if name == SHORT_FIRST_ROW else no_priority
        rows[name] = run_row(
            batch, model, tokenizer, pool, policy, backend, show_stats, priority, **settings
        )
    return rows


def kv_bytes_per_token(model: str) -> int:
    """What a token's KV takes in an engine of `model` at the default dtype, from its config
    (a random model's is built: it is tiny)."""
    if model.startswith("random:"):
        config = random_checkpoint(model, torch.float32, "cpu").hf_config
    else:
        config = load_config(resolve_model(model))
    return ModelArch.from_hf(config).kv_bytes_per_token(EngineConfig().dtype)


def check_memory(bytes_needed: float) -> None:
    if bytes_needed > POOL_BYTES_CAP:
        raise SystemExit(
            f"an engine would hold {bytes_needed / 2**30:.1f} GiB of KV (the cap is "
            f"{POOL_BYTES_CAP / 2**30:.0f} GiB, so two fit in 24 GB): use fewer --agents"
        )


def completion_figures(row: RowResult) -> tuple[float, float, float]:
    """Mean, p90 and p99 program completion seconds of the programs that finished."""
    done = completed(row.completions_s)
    return statistics.mean(done), percentile(done, 0.9), percentile(done, 0.99)


def row_figures(row: RowResult, bound: int) -> str:
    """prefill, its ratio to the bound, mean / p90 / p99 completion and makespan: table cells
    (agent_replicas_bench.py's table)."""
    mean, p90, p99 = completion_figures(row)
    return (f"{row.computed:>9,} {row.computed / bound:>7.2f}x {mean:>7.1f} {p90:>7.1f} "
            f"{p99:>7.1f} {row.makespan_s:>8.1f}s")  # fmt: skip


# with --repeats, each row's figures over lru's of the same repeat: label -> figure
RATIOS_SHOWN = {"prefill": "ratio", "mean": "mean", "p99": "p99", "makespan": "makespan",
                "short p99": "short p99"}  # fmt: skip


def figures(batch: AgentBatch, row: RowResult, bound: int) -> dict[str, float]:
    """One run's table figures: prefill and its ratio to the bound, mean / p90 / p99
    completion, makespan, programs per second, the short programs' p99, retries."""
    mean, p90, p99 = completion_figures(row)
    return {
        "prefill": row.computed,
        "ratio": row.computed / bound,
        "mean": mean,
        "p90": p90,
        "p99": p99,
        "makespan": row.makespan_s,
        "prog/s": len(completed(row.completions_s)) / row.makespan_s,
        "short p99": short_p99(batch, row.completions_s),
        "retries": row.retries,
    }


def print_cell(batch: AgentBatch, rows: dict[str, list[RowResult]]) -> None:
    """The cell's table: each row's figures (medians over its runs, outputs equal only if
    every run's are); with repeats, each row's ratios to lru's run of the same repeat."""
    unbounded = rows["unbounded pool"][0]
    bound, reference = unbounded.computed, unbounded.outputs
    print(f"\n{batch.describe()}")
    print(f"working set {unbounded.working_set:,} tokens (estimated "
          f"{batch.working_set_tokens():,}), pool {batch.pool_tokens(unbounded.working_set):,}; "
          f"exact bound {bound:,} prefill tokens, analytic bound {unbounded.analytic_bound:,}"
          + ("" if not unbounded.evicted else
             f" (the unbounded pool evicted {unbounded.evicted:,}: not a bound)"))  # fmt: skip
    print(f"{'row':<26} {'prefill':>9} {'÷ bound':>8} {'mean s':>7} {'p90 s':>7} {'p99 s':>7} "
          f"{'makespan':>9} {'prog/s':>7} {'short p99':>9} {'retries':>7} "
          f"{'outputs':>8}")  # fmt: skip
    runs = {name: [figures(batch, row, bound) for row in results] for name, results in rows.items()}
    for name, results in rows.items():
        f = medians(runs[name])
        same = "equal" if all(row.outputs == reference for row in results) else "DIFFER"
        failed = sum(len(row.failures) for row in results)
        print(f"{name:<26} {f['prefill']:>9,.0f} {f['ratio']:>7.2f}x {f['mean']:>7.1f} "
              f"{f['p90']:>7.1f} {f['p99']:>7.1f} {f['makespan']:>8.1f}s {f['prog/s']:>7.3f} "
              f"{f['short p99']:>9.1f} {f['retries']:>7.0f} {same:>8}"
              + (f"  {failed} failed" if failed else ""))  # fmt: skip
    for name, results in rows.items():
        for failure in [f for row in results for f in row.failures][:2]:
            print(f"  {name}: {failure[:160]}")
    if len(runs.get("lru", ())) > 1:
        print_ratios({k: v for k, v in runs.items() if k != "unbounded pool"}, "lru", RATIOS_SHOWN)


def shape_with(shape, specs: list[str]):
    """`shape` with each `FIELD=LO-HI` (or `FIELD=VALUE`) of `specs` applied."""
    changes = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        key = key.replace("-", "_")
        number = float if "." in value else int
        lo, _, hi = value.partition("-")
        is_span = isinstance(getattr(shape, key), tuple)
        changes[key] = (number(lo), number(hi or lo)) if is_span else number(value)
    return vary(shape, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tiny", action="store_true", help=f"the tiny random model ({TINY_MODEL})")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: tiny with --tiny")
    parser.add_argument("--shape", action="append", default=[], metavar="FIELD=LO-HI",
                        help="change a range of the preset, e.g. rounds=10-40")  # fmt: skip
    parser.add_argument("--agents", type=int, help="default: drawn from the preset")
    parser.add_argument("--pool-fraction", type=float, help="default: drawn (0.25-0.6)")
    parser.add_argument("--page-size", type=int, help="default: drawn (1 or 16)")
    parser.add_argument("--time-scale", type=float, help="tool gaps x this (default: preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cells", type=int, default=1, help="cells, seeds seed, seed + 1, ...")
    parser.add_argument(
        "--attention", default="torch", help="torch (the reference): outputs compare"
    )
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS),
                        help="the rows after the unbounded pool")  # fmt: skip
    parser.add_argument("--stats", action="store_true", help="the scheduler's counters per row")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per row, interleaved; the table shows medians")  # fmt: skip
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model = TINY_MODEL if args.tiny else args.model
    shape = shape_with(PRESETS[args.preset or ("tiny" if args.tiny else "default")], args.shape)
    if args.time_scale is not None:
        shape = vary(shape, time_scale=args.time_scale)
    tokenizer = load_bench_tokenizer() if model.startswith("random:") else None
    runs = "one run per row" if args.repeats == 1 else f"{args.repeats} runs per row, medians"
    print(f"model {model}, attention {args.attention}; {runs}")
    for cell in range(args.cells):
        batch = draw_batch(shape, args.seed + cell, args.agents, args.pool_fraction, args.page_size)
        rows = run_cell(
            batch, model, tokenizer, args.attention, args.rows, args.stats, args.repeats
        )
        print_cell(batch, rows)


if __name__ == "__main__":
    main()
