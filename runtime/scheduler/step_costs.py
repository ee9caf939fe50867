"""StepCosts: what a decode step costs, measured, and so how long a draft is worth guessing.

A step of B decoding requests that also verifies D guessed tokens takes about t0(B) + b(B) * D
seconds. Per batch size it fits that line to the pure decode steps seen (an exponentially
decayed least-squares fit: the machine's load changes). A guessed token pays when the tokens
it is expected to add are worth its time: the i-th token of a request's draft is accepted with
probability about alpha^i (alpha: the request's per-token acceptance), it adds that many tokens
to the B a plain step makes in t0(B), and it costs b(B): so guess while

    alpha^i > rho(B) = B * b(B) / t0(B).

On a memory-bound step (one request, short contexts) rho is small and long drafts pay; where
verifying rows cost nearly what plain rows do (many requests, long contexts) rho nears 1 and
only near-certain guesses are made.
"""

from __future__ import annotations

import math

DECAY = 0.97  # per observed step: about the last 30 steps of a batch size count
MIN_STEPS = 6  # before a fit is trusted
MIN_SPREAD = 0.25  # variance of D (tokens^2) a slope needs


class StepCosts:
    """Per batch size: decayed sums for the fit seconds = t0 + b * draft_tokens."""

    def __init__(self) -> None:
        self._sums: dict[int, list[float]] = {}  # B -> [n, sum D, sum T, sum D^2, sum D*T]

    def observe(self, num_decodes: int, draft_tokens: int, seconds: float) -> None:
        """One pure decode step's wall time (no prefill in it)."""
        sums = self._sums.setdefault(num_decodes, [0.0] * 5)
        d, t = float(draft_tokens), seconds
        for i, value in enumerate((1.0, d, t, d * d, d * t)):
            sums[i] = sums[i] * DECAY + value

    def fit(self, num_decodes: int) -> tuple[float, float] | None:
        """(t0 seconds, b seconds per guessed token), or None while unknown."""
        sums = self._sums.get(num_decodes)
        if sums is None or sums[0] < MIN_STEPS:  # sums[0]: the decayed count of steps
            return None
        n, sd, st, sdd, sdt = sums
        mean_d, mean_t = sd / n, st / n
        var_d = sdd / n - mean_d * mean_d
        if var_d < MIN_SPREAD:
            return None
        slope = (sdt / n - mean_d * mean_t) / var_d
        intercept = mean_t - slope * mean_d
        if intercept <= 0:
            return None
        return intercept, max(0.0, slope)

    def worth(self, num_decodes: int, alpha: float, limit: int) -> int:
        """How many tokens a request with per-token acceptance `alpha` should guess in a step
        of `num_decodes` requests (at most `limit`); `limit` while the costs are unknown."""
        fit = self.fit(num_decodes)
        if fit is None:
            return limit
        t0, per_token = fit
        rho = num_decodes * per_token / t0
        if rho <= 0:
            return limit
        if rho >= 1 or alpha <= rho:
            return 0
        if alpha >= 1:
            return limit
        return min(limit, int(math.log(rho) / math.log(alpha)))
