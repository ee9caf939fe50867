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

A batch size seen too seldom for a fit of its own (a fork's branches start and finish at
different steps, so its batch changes every few steps) takes a fit over every batch size,
seconds = a + c * B + b * D: what its steps are expected to cost, not a guess at full length.
"""

from __future__ import annotations

import math

import torch

DECAY = 0.97  # per observed step: about the last 30 steps of a batch size count
MIN_STEPS = 6  # before a fit is trusted
MIN_SPREAD = 0.25  # variance of D (tokens^2) a slope needs


class StepCosts:
    """Per batch size: decayed sums for the fit seconds = t0 + b * draft_tokens."""

    def __init__(self) -> None:
        self._sums: dict[int, list[float]] = {}  # B -> [n, sum D, sum T, sum D^2, sum D*T]
        # every batch size: decayed X'X (3 x 3) and X'T of the rows x = (1, B, D)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xt = [0.0] * 3
        self._pooled: tuple[float, float, float] | None = None  # (a, c, b), solved once per step
        self._pooled_stale = True

    def observe(self, num_decodes: int, draft_tokens: int, seconds: float) -> None:
        """One pure decode step's wall time (no prefill in it)."""
        sums = self._sums.setdefault(num_decodes, [0.0] * 5)
        d, t = float(draft_tokens), seconds
        for i, value in enumerate((1.0, d, t, d * d, d * t)):
            sums[i] = sums[i] * DECAY + value
        x = (1.0, float(num_decodes), d)
        for i in range(3):
            self._xt[i] = self._xt[i] * DECAY + x[i] * t
            for j in range(3):
                self._xx[i][j] = self._xx[i][j] * DECAY + x[i] * x[j]
        self._pooled_stale = True

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

    def pooled_fit(self, num_decodes: int) -> tuple[float, float] | None:
        """(t0, b) for `num_decodes` from the fit over every batch size, or None while the
        steps seen do not pin it down (too few, one batch size, or drafts of one length)."""
        if self._pooled_stale:
            self._pooled, self._pooled_stale = self._solve_pooled(), False
        if self._pooled is None:
            return None
        a, per_request, per_token = self._pooled
        t0 = a + per_request * num_decodes
        if t0 <= 0:
            return None
        return t0, max(0.0, per_token)

    def _solve_pooled(self) -> tuple[float, float, float] | None:
        xx = self._xx
        n = xx[0][0]
        if n < MIN_STEPS:
            return None
        mean_b, mean_d = xx[0][1] / n, xx[0][2] / n
        var_b = xx[1][1] / n - mean_b**2
        if var_b < MIN_SPREAD:
            return None
        # D's spread that B does not explain: drafts proportional to the batch (every request
        # guessing alike) would leave the two slopes unsolvable
        cov_bd = xx[1][2] / n - mean_b * mean_d
        if xx[2][2] / n - mean_d**2 - cov_bd**2 / var_b < MIN_SPREAD:
            return None
        coef = torch.linalg.solve(
            torch.tensor(xx, dtype=torch.float64), torch.tensor(self._xt, dtype=torch.float64)
        )
        a, per_request, per_token = coef.tolist()
        return a, per_request, per_token

    def worth(self, num_decodes: int, alpha: float, limit: int) -> int:
        """How many tokens a request with per-token acceptance `alpha` should guess in a step
        of `num_decodes` requests (at most `limit`); `limit` while the costs are unknown."""
        fit = self.fit(num_decodes) or self.pooled_fit(num_decodes)
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
