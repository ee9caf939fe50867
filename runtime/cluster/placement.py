"""Graph-aware placement: split a batch of program instances across replicas before it runs.

Each instance is known by its compiled prefix (the token ids its first request sends, which its
later requests extend) and the tokens it computes beyond that prefix (decoding, later turns).

1. Order the instances depth-first through their prefix tree: sorting token sequences does it,
   and it leaves every group that shares a prefix contiguous, deeper groups nested inside.
2. Cut that order into at most `num_replicas` contiguous runs. A run computes the union of its
   prefixes (in this order: the first prefix whole, then each prefix past what it shares with
   its predecessor) plus its instances' own tokens; so a cut between neighbours that share `k`
   tokens makes those `k` tokens be computed on both sides.
3. Choose the cuts exactly, by dynamic programming over cut positions (O(R n^2) for n instances
   and R replicas): first the least possible cost of the busiest replica, then, among cuts whose
   every run stays within `slack` of that, the least total cost.

So load is balanced on the tokens each replica will actually compute, and within that balance
the instances sharing the deepest prefixes stay together. Request-by-request routing cannot do
this: it chooses before the rest of a group has arrived, and its balance guard splits groups.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from runtime.prefix import common_prefix_len


@dataclass(frozen=True, slots=True)
class Instance:
    """One program instance: its cache namespace, compiled prefix, and the tokens it will
    compute past that prefix (decoded tokens, later turns' new text)."""

    namespace: Hashable
    prefix_ids: tuple[int, ...]
    num_extra_tokens: int = 0


def place_batch(instances: Sequence[Instance], num_replicas: int, slack: float = 0.1) -> list[int]:
    """The replica index (0..num_replicas-1) of each instance.

    >>> a, b = (1,) * 40, (2,) * 40
    >>> place_batch([Instance(None, p + (i,)) for i, p in enumerate((a, b, a, b))], 2)
    [0, 1, 0, 1]
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if slack < 0.0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    if not instances:
        return []
    order = sorted(range(len(instances)), key=lambda i: _sort_key(instances[i]))
    costs = _RunCosts([instances[i] for i in order])
    num_runs = min(num_replicas, len(order))
    busiest = _least_busiest(costs, num_runs)
    starts = _least_total(costs, num_runs, busiest * (1.0 + slack))
    placement = [0] * len(instances)
    for run, (start, end) in enumerate(zip(starts, [*starts[1:], len(order)], strict=True)):
        for position in range(start, end):
            placement[order[position]] = run
    return placement


class _RunCosts:
    """cost(a, b): tokens a replica computes for the instances at positions [a, b)."""

    def __init__(self, ordered: list[Instance]) -> None:
        self.num_instances = len(ordered)
        # shared[i]: what position i shares with i - 1 (0 for the first, or across namespaces)
        self.shared = [0] + [_shared_len(a, b) for a, b in zip(ordered, ordered[1:], strict=False)]
        self.cumulative = [0]  # union-in-order plus own tokens of positions [0, p)
        for instance, shared in zip(ordered, self.shared, strict=True):
            own = len(instance.prefix_ids) - shared + instance.num_extra_tokens
            self.cumulative.append(self.cumulative[-1] + own)

    def __call__(self, start: int, end: int) -> int:
        return self.cumulative[end] - self.cumulative[start] + self.shared[start]


def _least_busiest(costs: _RunCosts, num_runs: int) -> float:
    """The least possible cost of the costliest run, over cuts into at most `num_runs` runs."""
    n = costs.num_instances
    best = [0.0] + [math.inf] * n  # best[b]: over positions [0, b), with the runs so far
    answer = math.inf
    for _ in range(num_runs):
        best = [math.inf] + [
            min(max(best[a], costs(a, b)) for a in range(b)) for b in range(1, n + 1)
        ]
        answer = min(answer, best[n])
    return answer


def _least_total(costs: _RunCosts, num_runs: int, cap: float) -> list[int]:
    """Start positions of the runs with the least total cost, each run costing <= cap."""
    n = costs.num_instances
    best = [0.0] + [math.inf] * n
    layers: list[list[int | None]] = []  # per run count, per end: where the last run starts
    answer, answer_runs = math.inf, 0
    for runs in range(1, num_runs + 1):
        layer, starts = [math.inf], [None]
        for b in range(1, n + 1):
            total, start = math.inf, None
            for a in range(b):
                cost = costs(a, b)
                if cost <= cap and best[a] + cost < total:
                    total, start = best[a] + cost, a
            layer.append(total)
            starts.append(start)
        best = layer
        layers.append(starts)
        if best[n] < answer:
            answer, answer_runs = best[n], runs
    cuts, end = [], n
    for starts in reversed(layers[:answer_runs]):  # walk the chosen runs back from the end
        end = starts[end]
        cuts.append(end)
    return cuts[::-1]


def _sort_key(instance: Instance) -> tuple:
    return (str(instance.namespace), instance.prefix_ids)


def _shared_len(a: Instance, b: Instance) -> int:
    if a.namespace != b.namespace:
        return 0
    return common_prefix_len(a.prefix_ids, b.prefix_ids)
