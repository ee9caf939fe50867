"""The agent-trace family (examples/benchmarks/agent_traces.py) and its replay program
(programs/agent_trace.py): the generator's draws keep to the family's ranges and its gap
distribution, seeds reproduce, and a small batch on the tiny random model computes exactly the
analytic prefill bound with an unbounded pool, more under lru with a small pool, and the same
greedy outputs under lru, graph and the unbounded pool."""

from __future__ import annotations

import itertools
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from programs.agent_trace import TOOL_NAMES, WORDS, words_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "benchmarks"))
import agent_trace_bench as bench  # noqa: E402
import agent_traces as traces  # noqa: E402
import repeat_rows  # noqa: E402

SEEDS = range(12)


def within(value, span) -> bool:
    return span[0] <= value <= span[1]


def test_words_are_one_token_each(default_tokenizer):
    for word in WORDS:
        assert len(default_tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
    text = words_text(400, "k")
    assert len(default_tokenizer.encode(text, add_special_tokens=False)) == 400
    assert text == words_text(400, "k") != words_text(400, "other")


def test_gaps_follow_the_coding_agent_distribution():
    rng = random.Random(7)
    draws = [traces.draw_gap_s(rng) for _ in range(40_000)]
    gaps = [g for g, _ in draws]
    assert abs(sum(g <= 1.0 for g in gaps) / len(gaps) - 0.86) < 0.01
    assert abs(sum(g <= 10.0 for g in gaps) / len(gaps) - 0.95) < 0.01
    assert max(gaps) > 30 and min(gaps) >= 0.02 and max(gaps) <= 60
    assert {name for _, name in draws} == set(TOOL_NAMES)
    # the slow tools are the slow calls (what each tool declares is its bucket's middle)
    assert all(g >= 10 for g, name in draws if name == "run_tests")


@pytest.mark.parametrize("preset", sorted(traces.PRESETS))
def test_every_field_keeps_to_its_range(preset):
    shape = traces.PRESETS[preset]
    for seed in SEEDS:
        batch = traces.draw_batch(shape, seed)
        assert within(len(batch.agents), shape.agents)
        assert within(batch.pool_share, shape.pool_share) and batch.page_size in (1, 16)
        spawning = [a for a in batch.agents if a.subagents]
        assert within(len(spawning) / len(batch.agents), shape.spawn_share)
        for agent in batch.agents:
            assert within(agent.context_tokens, shape.context_tokens)
            assert within(len(agent.rounds), shape.rounds)
            assert within(agent.answer_tokens, shape.answer_tokens)
            rounds = list(agent.rounds)
            if agent.subagents:
                assert within(len(agent.subagents), shape.subagents)
                assert 0 <= agent.fork_after_round < len(agent.rounds) - 1
            for sub in agent.subagents:
                assert within(sub.task_tokens, shape.subagent_task_tokens)
                assert within(len(sub.rounds), shape.subagent_rounds)
                assert within(sub.report_tokens, shape.report_tokens)
                rounds += sub.rounds
            for round_ in rounds:
                assert within(round_.assistant_tokens, shape.assistant_tokens)
                assert len(round_.calls) in (1, 2)
                for call in round_.calls:
                    assert call.tool in TOOL_NAMES and 0.02 <= call.gap_s <= 60
                    assert within(call.result_tokens, shape.result_tokens)
        assert batch.working_set_tokens() > sum(a.context_tokens for a in batch.agents)


def test_the_drawn_shares_land_in_their_ranges_across_seeds():
    shape = traces.PRESETS["family"]
    batches = [traces.draw_batch(shape, seed) for seed in range(40)]
    for batch in batches:
        rounds = [r for a in batch.agents for r in a.rounds]
        parallel = sum(len(r.calls) == 2 for r in rounds) / len(rounds)
        assert abs(parallel - batch.parallel_share) < 0.1
    lengths = [len(a.rounds) for b in batches for a in b.agents]
    assert min(lengths) == 4 and max(lengths) >= 35  # the family's whole range is drawn
    assert len({len(b.agents) for b in batches}) > 10


def test_seeds_reproduce_and_differ():
    shape = traces.PRESETS["default"]
    assert traces.draw_batch(shape, 3) == traces.draw_batch(shape, 3)
    assert traces.draw_batch(shape, 3) != traces.draw_batch(shape, 4)
    fixed = traces.draw_batch(shape, 3, num_agents=9, pool_share=0.35, page_size=1)
    assert (len(fixed.agents), fixed.pool_share, fixed.page_size) == (9, 0.35, 1)
    varied = traces.vary(shape, rounds=(20, 30))
    assert all(20 <= len(a.rounds) <= 30 for a in traces.draw_batch(varied, 3).agents)


def test_arrivals_are_poisson_and_leave_the_agents_as_drawn():
    shape = traces.PRESETS["family"]
    at_once = traces.draw_batch(shape, 2, num_agents=400)
    arriving = traces.draw_batch(traces.vary(shape, arrivals_per_s=2.0), 2, num_agents=400)
    assert {a.arrival_s for a in at_once.agents} == {0.0}
    assert [replace(a, arrival_s=0.0) for a in arriving.agents] == list(at_once.agents)
    times = sorted(a.arrival_s for a in arriving.agents)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and abs(sum(gaps) / len(gaps) - 0.5) < 0.1  # mean gap 1 / rate
    first_half = [len(a.rounds) for a in arriving.agents if a.arrival_s <= times[200]]
    assert max(first_half) >= 30 and min(first_half) == 4  # short and long mix through the run


def test_short_programs_are_counted_by_their_subagents_rounds_too():
    """A 2-round agent that forks subagents is not short beside 3-round agents that do not:
    its size is its rounds and its subagents' (agent_rounds), for short_p99 and the declared
    short-first priority."""
    mix = traces.vary(traces.PRESETS["default"], rounds=(2, 16))  # the short/long mix, seed 0
    batch = traces.draw_batch(mix, 0, num_agents=8, pool_share=0.35, page_size=1)
    forking = next(a for a in batch.agents if a.subagents and len(a.rounds) == 2)
    plain = [a for a in batch.agents if not a.subagents]
    sizes = {id(a): len(a.rounds) + sum(len(s.rounds) for s in a.subagents) for a in batch.agents}
    assert traces.agent_rounds(forking) == sizes[id(forking)] > 2
    assert all(traces.agent_rounds(a) == len(a.rounds) for a in plain)
    # completions equal to the sizes: the short ones' p99 is the largest size within the
    # median, which the forking agent's completion is not (by its own 2 rounds it would be)
    completions = [float(sizes[id(a)]) for a in batch.agents]
    median = statistics.median(sizes.values())
    assert sizes[id(forking)] > median
    assert bench.short_p99(batch, completions) == max(v for v in sizes.values() if v <= median)
    assert bench.shortest_first({"trace": forking}) == -sizes[id(forking)]


def test_repeats_run_every_row_once_a_repeat_in_rotated_order():
    assert repeat_rows.interleaved(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b"),
    ]  # fmt: skip
    assert repeat_rows.interleaved(["a"], 2) == [(0, "a"), (1, "a")]


def test_repeated_rows_are_shown_as_medians_and_ratios_to_lrus_run_of_the_same_repeat(
    monkeypatch, capsys
):
    """run_cell with repeats: the unbounded row once, then the rows interleaved; the table
    shows each row's median figures, outputs 'equal' only if every run's are, and each row's
    ratios to lru's run of the same repeat (median [range])."""
    batch = traces.draw_batch(SMALL, seed=5, num_agents=4, pool_share=0.3, page_size=1)
    agents = len(batch.agents)
    # (row, repeat) -> (prefill, makespan); every program completes at the makespan
    runs = {
        ("lru", 0): (300, 10.0),
        ("lru", 1): (300, 20.0),
        ("lru", 2): (330, 40.0),
        ("gate", 0): (120, 5.0),
        ("gate", 1): (150, 30.0),
        ("gate", 2): (180, 20.0),
    }
    calls = []

    def fake_row(batch, model, tokenizer, capacity, policy, *args, record_trace=False, **kw):
        if record_trace:
            return bench.RowResult(100, 0, [1.0] * agents, [("x",)] * agents, [], 1.0, 400,
                                   100, 1, 0)  # fmt: skip
        name = "lru" if policy == "lru" else "gate"
        repeat = sum(1 for c in calls if c == name)
        calls.append(name)
        prefill, makespan = runs[name, repeat]
        outputs = [("x",)] * agents if (name, repeat) != ("gate", 1) else [("y",)] * agents
        return bench.RowResult(prefill, 0, [makespan] * agents, outputs, [], makespan, 0, 0, 1, 0)

    monkeypatch.setattr(bench, "run_row", fake_row)
    monkeypatch.setattr(bench, "kv_bytes_per_token", lambda model: 1)
    rows = bench.run_cell(batch, "m", None, "torch", ["lru", bench.PROGRAMS_ROW], repeats=3)
    assert calls == ["lru", "gate", "gate", "lru", "lru", "gate"]
    assert [len(rows[name]) for name in rows] == [1, 3, 3]
    bench.print_cell(batch, rows)
    out = capsys.readouterr().out
    lru_line = next(line for line in out.splitlines() if line.startswith("lru "))
    gate_line = next(line for line in out.splitlines() if line.startswith(bench.PROGRAMS_ROW))
    assert lru_line.split()[1:3] == ["300", "3.00x"] and "20.0s" in lru_line
    assert gate_line.removeprefix(bench.PROGRAMS_ROW).split()[:2] == ["150", "1.50x"]
    assert "20.0s" in gate_line
    assert lru_line.split()[-1] == "equal" and gate_line.split()[-1] == "DIFFER"
    # makespans over lru's of the same repeat: 0.5, 1.5, 0.5
    assert "makespan 0.50x [0.50-1.50]" in out


# ---------------------------------------------------------------------- on the tiny model

SMALL = replace(traces.PRESETS["tiny"], rounds=(4, 4), context_tokens=(200, 300))


@pytest.fixture(scope="module")
def batch():
    batch = traces.draw_batch(SMALL, seed=5, num_agents=8, pool_share=0.3, page_size=1)
    assert any(a.subagents for a in batch.agents)
    assert any(len(r.calls) == 2 for a in batch.agents for r in a.rounds)
    return batch


@pytest.fixture(scope="module")
def unbounded(tiny_model_dir, batch):
    capacity = 3 * batch.working_set_tokens()
    return bench.run_row(batch, str(tiny_model_dir), None, capacity, "lru", record_trace=True)


def test_counters_are_exact_and_outputs_equal_under_every_policy(tiny_model_dir, batch, unbounded):
    model = str(tiny_model_dir)
    capacity = 3 * batch.working_set_tokens()
    assert unbounded.evicted == 0 and not unbounded.failures
    # the exact bound: each shared prefix once, each reply's KV reused by the next round
    assert unbounded.computed == unbounded.analytic_bound
    again = bench.run_row(batch, model, None, capacity, "graph")
    assert again.computed == unbounded.computed and again.outputs == unbounded.outputs
    pool = batch.pool_tokens(unbounded.working_set)
    assert pool < unbounded.working_set
    for policy in ("lru", "graph"):
        row = bench.run_row(batch, model, None, pool, policy)
        assert not row.failures and row.outputs == unbounded.outputs, policy
        assert row.computed > unbounded.computed, policy
        assert row.evicted > 0
    assert len(unbounded.completions_s) == len(batch.agents)
    assert max(unbounded.completions_s) <= unbounded.makespan_s


OTHER_ROWS = [n for n in bench.ROWS if n not in ("lru", bench.HOST_ROW, bench.PROGRAMS_HOST_ROW)]


@pytest.mark.parametrize("name", OTHER_ROWS)
def test_every_baseline_row_replays_the_batch_with_the_same_outputs(
    tiny_model_dir, batch, unbounded, name
):
    """The bench's other rows (graph request by request, priority hints, TTL pins, the program
    gate) under the small pool: every program finishes with the unbounded run's outputs."""
    rows = bench.run_cell_rows(batch, str(tiny_model_dir), None, unbounded, [name])
    row = rows[name]
    assert not row.failures and row.outputs == unbounded.outputs
    assert row.computed >= unbounded.computed
    # what the returns computed again is part of what the row computed over the exact bound
    assert 0 <= row.returns_recomputed <= row.computed - unbounded.computed
    if name == bench.PROGRAMS_ROW:
        assert row.returns_recomputed > 0  # (the pool is short: some paused path was lost)
