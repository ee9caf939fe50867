"""StepTime: what an engine step costs per token it computes, measured, and so how many tokens
fit in a step of a given length.

A step that computes N tokens (prompt, forced, decoded and guessed, all requests together)
takes about t0 + c * N seconds: t0 is reading the weights once (on 2 CPU cores and the default
model ~40 ms, on a GPU well under one), c what each token adds. The line is fitted to every step
seen, with exponential decay (the machine's load and the contexts' lengths change). A token
budget fixed in tokens is wrong on every machine but one: 64 tokens are ~0.15 s on 2 cores and
nothing on an H100. A budget in seconds, turned into tokens by this fit, holds on both.

IdleTime: the seconds the engine sat between steps, so that a program held out of an engine
that idles can tell what its wait wastes (programs.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

DECAY = 0.95  # per observed step: about the last 20 steps count
MIN_STEPS = 4.0  # (decayed) steps before a fit is trusted
MIN_SPREAD = 4.0  # variance of N (tokens^2) a slope needs: decode steps alone do not fit it


class StepTime:
    """Decayed sums for the fit seconds = t0 + c * tokens."""

    def __init__(self) -> None:
        self._n = self._sum_tokens = self._sum_s = self._sum_tokens2 = self._sum_tokens_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's forward + sample time and the tokens it computed."""
        x = float(num_tokens)
        self._n = self._n * DECAY + 1.0
        self._sum_tokens = self._sum_tokens * DECAY + x
        self._sum_s = self._sum_s * DECAY + seconds
        self._sum_tokens2 = self._sum_tokens2 * DECAY + x * x
        self._sum_tokens_s = self._sum_tokens_s * DECAY + x * seconds

    def fit(self) -> tuple[float, float] | None:
        """(t0 seconds, seconds per token), or None while the steps seen do not pin it down."""
        n = self._n
        if n < MIN_STEPS:
            return None
        mean_x, mean_s = self._sum_tokens / n, self._sum_s / n
        var_x = self._sum_tokens2 / n - mean_x * mean_x
        if var_x < MIN_SPREAD:
            return None
        per_token_s = (self._sum_tokens_s / n - mean_x * mean_s) / var_x
        if per_token_s <= 0:
            return None
        return max(0.0, mean_s - per_token_s * mean_x), per_token_s

    def tokens_within(self, seconds: float) -> int | None:
        """How many tokens a step of `seconds` computes (0 if its fixed cost alone is over),
        or None while unknown."""
        fit = self.fit()
        if fit is None:
            return None
        t0, per_token_s = fit
        return max(0, int((seconds - t0) / per_token_s))


class IdleTime:
    """Seconds the engine has sat between steps (a step: from scheduling it to its outputs
    processed), in all: time a request waits while the engine idles is compute it could have
    had. Near none where compute is what requests wait for (the default model on 2 cores);
    about half the time where they wait on their tools and clients (the tiny model on the
    agent family)."""

    def __init__(self) -> None:
        self.clock: Callable[[], float] = time.monotonic  # (tests move a fake one)
        self._idle_s = 0.0
        self._step_start_s = 0.0
        self._last_end_s: float | None = None

    def step_started(self) -> None:
        self._step_start_s = self.clock()

    def step_ended(self) -> None:
        if self._last_end_s is not None:
            self._idle_s += max(0.0, self._step_start_s - self._last_end_s)
        self._last_end_s = self.clock()

    def total_s(self) -> float:
        """Idle seconds until now, the gap since the last step included."""
        if self._last_end_s is None:
            return 0.0
        return self._idle_s + max(0.0, self.clock() - self._last_end_s)
