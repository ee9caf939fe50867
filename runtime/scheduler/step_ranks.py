"""Programs ranked higher get short steps: while a request of the best rank runs, the prompt
tokens of the requests ranked below it are capped to what a `shared_step_ms` step computes.

A request's rank is its program's (programs.py): its GraphHints.priority, then its service level
(less attained service first: Autellix's PLAS, applied to compute as the program gate applies it
to the pool). A step's time is about its computed tokens (step_time.py): on 2 CPU cores a
1,024-token prefill chunk makes every decode in the step wait ~1.5 s. Admission alone does not
put a short program first: once in, its decodes ride steps filled by long programs' prompts (a
newcomer has the least service, and a program that asks for little is done before it climbs).
Autellix preempts lower queues for it, SGLang lower priorities (`--enable-priority-scheduling`);
here the requests ranked below keep their KV and their decodes (a decode is one token: batching
it costs little), and their prompts go on at a short step's worth of tokens a step, so none
starves. The best rank's prompts take the step's budget first, in admission order. Side by side
on the short/long agent mix it lowered every completion figure in both seed-0 cells (the arriving
cell's short programs' p99 0.90x lru's to 0.59x); over six runs of that cell the gate's mean
was 0.72-1.30x lru's (RESULTS.md, "Short steps for the programs ranked below" and "Short
programs counted with their subagents").

With every running request at one rank nothing here changes a step.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from runtime.scheduler.entries import BatchEntry
from runtime.scheduler.request import Req
from runtime.scheduler.shares import shared_step_tokens

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler

UNCAPPED = sys.maxsize


def rank_of(s: Scheduler, req: Req) -> tuple[int, ...]:
    """A request's step rank, the lowest first: its program's (priority, then service level)."""
    return s.lookahead.programs.request_rank(req)


class StepRanks:
    """One step's ranks: the best rank among the running requests, and the prompt tokens left
    for the requests ranked below it (UNCAPPED when none is)."""

    def __init__(self, s: Scheduler) -> None:
        self._ranks = {id(r): rank_of(s, r) for r in (*s.running, *s.waiting.values())}
        running = [self._ranks[id(r)] for r in s.running]
        self.best = min(running, default=())
        below = running and any(rank > self.best for rank in self._ranks.values())
        self.lower_left_tokens = shared_step_tokens(s) if below else UNCAPPED

    def order(self, reqs: Iterable[Req]) -> list[Req]:
        """`reqs` by rank, the best first (a stable sort: admission order within a rank)."""
        return sorted(reqs, key=lambda r: self._ranks[id(r)])

    def room(self, req: Req, budget: int) -> int:
        """The prompt tokens `req` may compute within the step's `budget` left."""
        return budget if self._ranks[id(req)] <= self.best else min(budget, self.lower_left_tokens)

    def took(self, req: Req, num_tokens: int) -> None:
        if self._ranks[id(req)] > self.best:
            self.lower_left_tokens -= num_tokens

    def admitted(self, entries: Iterable[BatchEntry]) -> None:
        for entry in entries:
            self.took(entry.req, entry.num_new)

    def admission_budget(self, budget: int) -> int:
        """What admission may start this step: waiting requests of any rank within the lower
        ranks' cap (one of the best rank takes its whole budget from its next step on)."""
        return min(budget, self.lower_left_tokens)
