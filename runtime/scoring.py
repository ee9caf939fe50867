"""Continuation scoring with every token computed once (what `select` is decided from).

The continuations form a trie under the prefix. Every trie node whose next-token row is needed
and that two or more continuations share (the prefix itself first) is pinned with its last
logprob row kept; each continuation then computes only its own unshared tail, with prompt
logprobs from where it diverges.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import torch

from runtime.errors import InvalidRequestError
from runtime.intake import RequestIntake
from runtime.protocol import GraphHints, PinInfo, ScoreRequest, ScoreResult
from runtime.scheduler.request import Req

# Each shared trie node costs a pin (one engine round trip): sharing pays for the short common
# heads of select choices; past these bounds each continuation computes its own rows instead
# (its prefix still comes from the cache), so hostile continuations cannot pile up pins.
MAX_SHARED_DEPTH = 8
MAX_SHARED_PINS = 32
# A score's continuations go to the engine MAX_SCORE_BATCH at a time: each finished one holds
# a full-vocabulary row until its logprobs are read, and a batch at a time lets other requests
# in between batches (thousands added at once would queue everyone else behind them).
MAX_SCORE_BATCH = 64
MAX_SCORE_CONTINUATIONS = 1024  # per call (InvalidRequestError beyond)

Context = tuple[int, ...]  # a continuation's tokens before the one being scored
NextLogprobs = dict[int, float]  # token id -> logprob, for the tokens scored after a context
PinFn = Callable[[list[int], str | None, GraphHints, bool], tuple[PinInfo, torch.Tensor | None]]


def check_score_size(request: ScoreRequest) -> None:
    """Refuse a score of more than MAX_SCORE_CONTINUATIONS continuations."""
    num_conts = len(request.continuations)
    if num_conts > MAX_SCORE_CONTINUATIONS:
        raise InvalidRequestError(
            f"a score of {num_conts:,} continuations exceeds the limit of "
            f"{MAX_SCORE_CONTINUATIONS:,} per call: split it"
        )


def num_in_flight(request: ScoreRequest) -> int:
    """Engine requests a score has in flight at once, at most (its continuation batch)."""
    return min(len(request.continuations), MAX_SCORE_BATCH)


class ScoreCancelled(Exception):
    """The score was cancelled (its client went away) before it finished."""


class Cancellation:
    """Stops a score from another thread: the requests it has in flight are aborted at once,
    and it raises ScoreCancelled at its next step (a pin being prefilled finishes first: the
    engine names a pin only once it is made)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._inflight: list[str] = []
        self._abort: Callable[[str], None] | None = None
        self._stops: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Cancel the score (from any thread)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            rids, abort, stops = self._inflight, self._abort, self._stops
        for rid in rids:
            abort(rid)
        for stop in stops:
            stop()

    def on_cancel(self, stop: Callable[[], None]) -> None:
        """Also call `stop` when the score is cancelled (at once if it already is): for a
        score that runs elsewhere, on a replica."""
        with self._lock:
            if not self._cancelled:
                self._stops.append(stop)
                return
        stop()

    def check(self) -> None:
        """Raise ScoreCancelled if the score was cancelled."""
        if self._cancelled:
            raise ScoreCancelled("the score was cancelled")

    def run(
        self, run: Callable[[list[Req]], None], abort: Callable[[str], None], reqs: list[Req]
    ) -> None:
        """`run(reqs)`, aborting them if the score is cancelled meanwhile."""
        with self._lock:
            self.check()
            self._inflight, self._abort = [r.rid for r in reqs], abort
        try:
            run(reqs)
        finally:
            with self._lock:
                self._inflight = []
        self.check()  # aborted requests finish without rows: never read them


class ContinuationScorer:
    """Scores one ScoreRequest at a time over an engine's pin/run/abort operations."""

    def __init__(
        self,
        intake: RequestIntake,
        pin: PinFn,
        abort: Callable[[str], None],
        run: Callable[[list[Req]], None],
        share_prefixes: bool,
    ) -> None:
        self.intake = intake
        self._pin = pin  # prefill + lock ids, keeping the last row: (info, row)
        self._abort = abort  # release a pin or stop a request, by id (the scheduler does both)
        self._run = run  # add requests and wait until every one finished (raises on error)
        self.share_prefixes = share_prefixes  # False without a prefix cache: pins hold nothing

    def score(self, request: ScoreRequest, cancel: Cancellation | None = None) -> ScoreResult:
        """Per-token logprobs of each continuation after the prefix; `cancel` may stop it
        (ScoreCancelled) from another thread."""
        cancel = cancel or Cancellation()
        check_score_size(request)
        prefix_ids = self.intake.tokens(request.prefix, special=True)
        conts = [self.intake.tokens(c, special=False) for c in request.continuations]
        if any(not c for c in conts):
            raise InvalidRequestError("every continuation needs at least one token")
        for cont in conts:
            self.intake.validate_ids(cont, "continuation token id")
        self.intake.validate_prompt(prefix_ids, max(map(len, conts)))
        rows: dict[Context, NextLogprobs] = {}
        pin_ids: list[str] = []
        token_logprobs: list[list[float]] = []
        try:
            for context in self._shared_contexts(conts):  # shortest first: one new token each
                cancel.check()
                info, row = self._pin(
                    prefix_ids + list(context), request.namespace, request.hints, True
                )
                pin_ids.append(info.pin_id)
                rows[context] = _next_logprobs(row, context, conts)
            for start in range(0, len(conts), MAX_SCORE_BATCH):
                batch = conts[start : start + MAX_SCORE_BATCH]
                reqs = self._tail_reqs(request, prefix_ids, batch, rows)
                token_logprobs += self._score_batch(reqs, prefix_ids, batch, rows, cancel)
        finally:
            for pin_id in pin_ids:
                self._abort(pin_id)
        return ScoreResult(
            prefix_ids=prefix_ids, continuation_ids=conts, token_logprobs=token_logprobs
        )

    def _score_batch(
        self,
        reqs: dict[int, Req],
        prefix_ids: list[int],
        conts: list[list[int]],
        rows: dict[Context, NextLogprobs],
        cancel: Cancellation,
    ) -> list[list[float]]:
        """Per-token logprobs of `conts`, running their tails' requests (`reqs`, by index in
        `conts`) together."""
        if reqs:
            cancel.run(self._run, self._abort, list(reqs.values()))
        token_logprobs = [
            [_token_logprob(rows, reqs.get(i), prefix_ids, cont, j) for j in range(len(cont))]
            for i, cont in enumerate(conts)
        ]
        for req in reqs.values():  # read: let the rows go now (a Req sits in reference cycles)
            req.logprobs.last, req.logprobs.values = None, []
        return token_logprobs

    def _shared_contexts(self, conts: list[list[int]]) -> list[Context]:
        """Trie nodes whose next-token row is needed by two or more continuations."""
        if not self.share_prefixes:
            return []
        shares: dict[Context, int] = {}
        rows_needed: set[Context] = set()
        for cont in conts:
            # only nodes up to MAX_SHARED_DEPTH can be shared: walking whole continuations
            # would cost their length squared (long hostile continuations: minutes, gigabytes)
            for m in range(min(len(cont), MAX_SHARED_DEPTH) + 1):
                node = tuple(cont[:m])
                shares[node] = shares.get(node, 0) + 1
                if m < len(cont):
                    rows_needed.add(node)
        shared = [n for n in rows_needed if shares[n] >= 2]
        return sorted(shared, key=len)[:MAX_SHARED_PINS]

    def _tail_reqs(
        self,
        request: ScoreRequest,
        prefix_ids: list[int],
        conts: list[list[int]],
        rows: dict[Context, NextLogprobs],
    ) -> dict[int, Req]:
        """One prefill per continuation that needs rows no pin brought."""
        reqs: dict[int, Req] = {}
        for i, cont in enumerate(conts):
            diverge = next((m for m in range(len(cont)) if tuple(cont[:m]) not in rows), None)
            if diverge is None:
                continue  # every row this continuation needs came with a pin
            # the last token's KV is never needed: its logprob is the last row's
            reqs[i] = self.intake.score_req(
                uuid.uuid4().hex,
                prefix_ids + cont[:-1],
                request.namespace,
                request.hints,
                logprob_start=len(prefix_ids) + diverge,
            )
        return reqs


def _next_logprobs(row: torch.Tensor, context: Context, conts: list[list[int]]) -> NextLogprobs:
    """Of a pinned node's full logprob row, only the tokens some continuation scores there."""
    depth = len(context)
    scored = {c[depth] for c in conts if len(c) > depth and tuple(c[:depth]) == context}
    return {token_id: float(row[token_id]) for token_id in scored}


def _token_logprob(
    rows: dict[Context, NextLogprobs],
    req: Req | None,
    prefix_ids: list[int],
    cont: list[int],
    j: int,
) -> float:
    """Logprob of cont[j]: from a pinned trie node's row, the request's prompt logprobs, or
    (the last token) the request's last row."""
    context = tuple(cont[:j])
    if context in rows:
        return float(rows[context][cont[j]])
    if j == len(cont) - 1:
        return float(req.logprobs.last[cont[j]])
    return float(req.logprobs.values[len(prefix_ids) + j])
