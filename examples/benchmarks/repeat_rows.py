"""Rows run more than once, interleaved, and reported as medians (agent_trace_bench.py
--repeats).

One run per row does not settle a wall-clock figure on a 2-core box: the program gate's
prefill at one agent cell went 1.14x, 1.34x, 1.36x and 1.47x the bound over four runs of the
same code, and its mean completion 0.72x-1.30x lru's over six runs of another (RESULTS.md). The
brief asks for side-by-side runs, interleaved, and medians: each repeat runs every row once, the
order rotated by one row per repeat so that no row always runs first or last on the machine;
a row's figures are the medians over its runs, and its ratios to a baseline row are taken run
by run against the baseline's run of the same repeat (the nearest in time), then their median
and range are shown.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def interleaved(rows: Sequence[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, row) in run order: every row once per repeat, each repeat starting one row
    later than the one before."""
    order = []
    for repeat in range(repeats):
        first = repeat % len(rows)
        order += [(repeat, name) for name in (*rows[first:], *rows[:first])]
    return order


def medians(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over `runs` (dicts with the same keys)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def ratios(
    runs: Sequence[dict[str, float]], base: Sequence[dict[str, float]], key: str
) -> list[float]:
    """`key` of each run over the baseline's run of the same repeat."""
    return [run[key] / other[key] for run, other in zip(runs, base, strict=True)]


def ratio_cell(values: Sequence[float]) -> str:
    """'median [lowest-highest]', or the one value."""
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def print_ratios(
    runs: dict[str, Sequence[dict[str, float]]], base: str, shown: dict[str, str]
) -> None:
    """Each row's `shown` figures (label -> figure) over `base`'s run of the same repeat:
    median [range]."""
    print(f"vs {base}, same repeat ({len(runs[base])} runs): " + ", ".join(shown))
    for name, row_runs in runs.items():
        if name != base:
            cells = [f"{label} {ratio_cell(ratios(row_runs, runs[base], key))}"
                     for label, key in shown.items()]  # fmt: skip
            print(f"  {name:<26} " + "  ".join(cells))
