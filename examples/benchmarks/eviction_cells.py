"""One cell of the eviction table: a multi-turn workload, an arrival order, a KV pool size and a
policy, run through flowlang programs on the engine (program_bench.py prints the table).

Cache counters need deterministic outputs, not meaningful ones, so the default model is a tiny
random-weight model with SmolLM2's vocabulary and the real tokenizer and chat template; replies
have a fixed length (ignore_eos, greedy). `--eviction-model smollm2-135m-instruct` runs the real
model instead. The oracle replays the future recorded by a first run of the same cell.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from arrivals import (
    PacedBackend,
    interleaved_arrivals,
    interleaved_schedule,
    rounds_schedule,
    think_hints,
    waves_of,
)

from flowlang.backends.local import LocalBackend
from programs import multi_turn_chat, support_agent
from runtime.cache.replay import working_set
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_tools import cache_trace, load_eviction_oracle, set_eviction_clock
from runtime.model.loader import load_tokenizer
from runtime.model.random_weights import PRESETS
from runtime.model.registry import resolve_model

TOKENIZER_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "random:smollm2-tiny"
PRESETS.setdefault(  # SmolLM2's vocabulary and context on a 2-layer, 64-wide body
    "smollm2-tiny",
    {
        **PRESETS["smollm2-135m"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
)
WAVE_SIZE = 8  # interleaved: requests released together
ATTENTION = "torch"  # the reference kernel (each cell asserts outputs equal to the unbounded run)
THINK_JITTER = 0.5  # interleaved: think times of 0.5-1.5 cycles
REPLY_SAMPLING = {"ignore_eos": True, "temperature": 0.0}


@dataclass(frozen=True)
class Workload:
    name: str
    program: object
    batch: list[dict]
    num_turns: int

    @property
    def num_users(self) -> int:
        return len(self.batch)


@dataclass(frozen=True)
class CellResult:
    prefill_computed: int
    cached: int
    hit_rate: float
    evicted: int
    wall_s: float
    trace: list[tuple]
    token_ids: list[tuple[int, ...]]  # every instance's final ids (equal across policies)


def load_bench_tokenizer():
    return load_tokenizer(resolve_model(TOKENIZER_MODEL))


def workloads(tokenizer, num_w1_users: int, num_w6_convs: int) -> list[Workload]:
    """W1 support agent and W6 multi-turn chat at the requested sizes (bench inputs)."""
    w1 = support_agent.make_inputs(tokenizer, "bench")
    w1 = type(w1)(w1.system_prompt, w1.fewshot, w1.users[:num_w1_users])
    w6 = multi_turn_chat.make_inputs(tokenizer, "bench")
    w6 = type(w6)(w6.system_prompt, w6.conversations[:num_w6_convs])
    return [
        Workload(
            f"W1 {len(w1.users)}x{len(w1.users[0].messages)}",
            support_agent.support_agent,
            support_agent.batch_args(w1),
            len(w1.users[0].messages),
        ),
        Workload(
            f"W6 {len(w6.conversations)}x{len(w6.conversations[0])}",
            multi_turn_chat.multi_turn_chat,
            multi_turn_chat.batch_args(w6),
            len(w6.conversations[0]),
        ),
    ]


def schedule_of(workload: Workload, order: str, think_jitter: float) -> list[list[tuple[int, int]]]:
    if order == "rounds":
        return rounds_schedule(workload.num_users, workload.num_turns)
    return interleaved_schedule(
        workload.num_users, workload.num_turns, WAVE_SIZE, think_jitter=think_jitter
    )


def run_cell(
    workload: Workload,
    order: str,
    model: str,
    tokenizer,
    capacity: int,
    policy: str,
    future: list[tuple] | None = None,
    think_jitter: float = THINK_JITTER,
    told_think_times: bool = False,
) -> CellResult:
    """Run the workload's batch in `order` with a `capacity`-slot pool under `policy`; with
    `told_think_times` (interleaved), every continuation declares when its next turn comes."""
    with cell_engine(model, tokenizer, capacity, policy, future) as engine:
        local = LocalBackend(engine)
        graphs = [workload.program.compile(backend=local, **args) for args in workload.batch]
        firsts = [g.first_prompt() for g in graphs]
        if told_think_times:
            if order != "interleaved":
                raise ValueError("think times are told only in the interleaved order")
            arrivals = interleaved_arrivals(
                workload.num_users, workload.num_turns, WAVE_SIZE, think_jitter=think_jitter
            )
            schedule = waves_of(arrivals, WAVE_SIZE)  # the very arrivals the hints are from
            wave_times, hints = think_hints(schedule, arrivals)
        else:
            schedule = schedule_of(workload, order, think_jitter)
            wave_times = hints = None
        backend = PacedBackend(local, firsts, schedule, wave_times, hints)
        if told_think_times:
            set_eviction_clock(engine, backend.clock)
        start = time.perf_counter()
        states = workload.program.run_batch(
            workload.batch, backend=backend, progress=False, sampling=REPLY_SAMPLING
        )
        return cell_result(engine, states, time.perf_counter() - start)


@contextmanager
def cell_engine(
    model: str,
    tokenizer,
    capacity: int,
    policy: str,
    future: list[tuple] | None = None,
    page_size: int = 1,
    engine_settings: dict | None = None,
) -> Iterator[Engine]:
    """An engine for one cell: a `capacity`-slot pool under `policy`, recording its trace; a
    random-weight model gets the real tokenizer; the oracle gets its recorded future;
    `engine_settings` are further EngineConfig fields (e.g. lower KV tiers)."""
    config = EngineConfig(
        model=model,
        max_kv_tokens=capacity,
        eviction_policy=policy,
        page_size=page_size,
        record_trace=True,
        attention_backend=ATTENTION,
        **(engine_settings or {}),
    )
    with Engine(config) as engine:
        if engine.tokenizer is None:  # a random-weight model: lend it the real tokenizer
            engine.tokenizer = engine.intake.tokenizer = tokenizer
        if policy == "oracle":
            load_eviction_oracle(engine, future or [])
        yield engine


def cell_result(engine: Engine, states: list, wall_s: float) -> CellResult:
    """A finished cell's counters, trace and outputs (every instance must have succeeded)."""
    failed = [s for s in states if not hasattr(s, "text")]
    assert not failed, failed
    engine.check_integrity()
    stats = engine.stats()
    return CellResult(
        stats["prefill_tokens_total"],
        stats["cached_tokens_total"],
        stats["cache_hit_rate"],
        stats["evicted_tokens_total"],
        wall_s,
        cache_trace(engine),
        [tuple(s.token_ids()) for s in states],
    )


def unbounded_run(
    workload: Workload, order: str, model: str, tokenizer, think_jitter: float = THINK_JITTER
) -> tuple[CellResult, int]:
    """A run with room for everything, and its working set in tokens (which sizes the pools)."""
    result = run_cell(workload, order, model, tokenizer, 400_000, "lru", None, think_jitter)
    return result, working_set(result.trace)
