"""GrammarGate: a constrained request samples only once its grammar mask is ready, so no
step waits long for grammar work.

Each constrained request's next mask is filled on the mask workers (constrain/masks.py) from
the moment it can be: at arrival (its first mask, filled while it waits), and right after each
sampled token (while the rest of the step is processed and the next one is scheduled). Before
a step the scheduler `prepare`s: it waits, at most `grammar_step_budget_ms` in all, for the
masks expected to be quick (those whose last fill took under the budget, or never ran), as long
as a worker is on them or free for them; a request whose mask is still not ready then sits this
step out: a decode is left out of the batch, a waiting request is not admitted. Nothing else
changes: it is scheduled in the first step after its mask is ready, and samples exactly the
token it would have sampled without waiting (greedy outputs are the same, only later).

Deferred requests always progress: their fills are queued earliest expected end first
(masks.py) whatever else arrives, and no step needs one to end. With a grammar whose every
mask takes a second (issue 35's hostile case), eight such requests made one step take 8-10 s,
and every other request in it waited; now steps take what their forward takes, and those
requests get a token each time their mask is ready.

Verifying a draft (speculative decoding) fills the masks after the first guessed token in the
step itself, so a constrained request guesses only as many tokens as its measured fill time
fits in the budget (none for a grammar whose masks take seconds).
"""

from __future__ import annotations

import time
from typing import Any

from runtime.constrain.masks import MaskWorkers
from runtime.scheduler.request import Req, ReqKind

IDLE_WAIT_S = 0.05  # with nothing to run but masks to wait for: the loop looks at its commands


class GrammarGate:
    """Starts mask fills, waits for quick ones within a step's budget, and says which
    constrained requests may sample now."""

    def __init__(self, step_budget_ms: float, num_threads: int) -> None:
        self.budget_s = step_budget_ms / 1000
        self.workers = MaskWorkers(num_threads)
        self.num_deferrals = 0  # decodes left out of a step: their mask was not ready
        self.num_admission_waits = 0  # admissions put off: the first mask was not ready

    def start(self, req: Req) -> None:
        """Begin filling `req`'s next mask (at arrival, after each sampled token)."""
        state = _constraint(req)
        if state is not None and not req.gen.finished:
            self.workers.submit(state)

    def ended(self, req: Req) -> None:
        """`req` finished: its fill is not needed any more."""
        state = _constraint(req)
        if state is not None:
            self.workers.cancel(state)

    def prepare(self, decoding: list[Req]) -> None:
        """Before a step: start the decoding requests' fills, then wait, at most the budget,
        while a pending fill (theirs, or a waiting request's first) is expected to be quick."""
        for req in decoding:
            state = _constraint(req)
            if state is not None and not state.mask_ready:
                self.workers.submit(state)
        if self.workers.num_pending:
            self.workers.wait_quick(self.budget_s, time.monotonic() + self.budget_s)

    def can_sample(self, req: Req, admitting: bool = False) -> bool:
        """Whether `req` may sample in this step: no grammar, or its mask is ready (if not,
        its fill is started and the deferral counted)."""
        state = _constraint(req)
        if state is None or state.mask_ready or self.workers.has_failed(state):
            return True  # (a failed fill is done again in the step, which reports its error)
        self.workers.submit(state)
        if admitting:
            self.num_admission_waits += 1
        else:
            self.num_deferrals += 1
        return False

    def max_draft_tokens(self, req: Req, limit: int) -> int:
        """How many guessed tokens `req` may verify in a step: each after the first needs a
        mask filled in the step, and together they must fit the budget."""
        state = _constraint(req)
        if state is None or limit <= 0:
            return limit
        if state.fill_s is None:
            return 0  # no fill measured yet
        if state.fill_s <= 0:
            return limit
        return min(limit, int(self.budget_s / state.fill_s))

    def idle(self) -> None:
        """Nothing can run: wait for a fill to end (a while at most: commands may come)."""
        self.workers.wait_any(IDLE_WAIT_S)

    def stats(self) -> dict[str, float]:
        return {
            "grammar_deferrals_total": self.num_deferrals,
            "grammar_admission_waits_total": self.num_admission_waits,
            "grammar_background_fills_total": self.workers.num_fills,
            "grammar_pending_fills": self.workers.num_pending,
        }


def _constraint(req: Req) -> Any:
    """The grammar state of a request that samples, or None."""
    return req.gen.constraint if req.kind is ReqKind.GENERATE else None
