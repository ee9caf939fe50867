"""Per-request output state: tokens, text, logprobs, stop conditions and sampler state."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.model.sampler import SamplerState
from runtime.protocol import SamplingParams
from runtime.stop_regex import MAX_PROGRAM_LEN, StopRegexMatcher

# automaton steps of stop_regex matching per engine step, all requests together (~10 ms in
# CPython): a pattern of 2,048 states reads ~3 characters a step, a plain one hundreds
STOP_REGEX_STEP_BUDGET = 8192


class StopBudget:
    """Automaton steps of stop_regex matching left in one engine step. The scheduler shares
    one among every request (n=4 copies of a heavy request cost one budget a step, not four)."""

    def __init__(self, steps: float = STOP_REGEX_STEP_BUDGET) -> None:
        self.left = steps


StopHit = tuple[int, int, str | int]  # (start, end, the stop) in the text


class GenerationState:
    """What one request has generated so far and whether it is done.

    `append(token_id)` applies the stop rules in order: EOS / stop token ids (after
    min_new_tokens, unless ignore_eos), stop strings and stop_regex matches (cut exactly where
    they start, even inside a token or across tokens; the earliest wins), then max_new_tokens.

    The engine bounds stop_regex matching per step (`new_step`): where a token's text needs
    more, the token's rules wait, tokens appended meanwhile (a jump-forward's) queue behind it,
    and `catch_up()` reads on in later steps. The request samples nothing until it caught up
    (`checking_stops`), so every outcome is the unbounded one, only later.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        tokenizer: Any,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        *,
        constraint: Any = None,
        default_generator: torch.Generator | None = None,
    ) -> None:
        self.params = params
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
        self.matched_stop: int | str | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self._stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self._stop_ids.update(eos_token_ids)
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._regex_stops = _RegexStops(params.stop_regex) if params.stop_regex else None
        # the token whose rules wait for stop_regex matching, with its stop-string hits; and
        # the tokens appended after it, whose rules come after its own
        self._waiting: tuple[int, list[StopHit]] | None = None
        self._held: deque[tuple] = deque()
        self._streamed_len = 0
        self._chunked_len = 0  # output tokens already handed out by take_new_outputs()
        self._detok = (
            IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.sampler = SamplerState.for_request(
            params, prompt_ids, vocab_size, constraint, default_generator
        )

    @property
    def constraint(self) -> Any:
        """The grammar state of a constrained request, or None."""
        return self.sampler.constraint

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def checking_stops(self) -> bool:
        """Whether stop_regex matching is behind the tokens appended (it reads a bounded
        amount a step): the request must not sample until catch_up() ended this."""
        return self._waiting is not None or bool(self._held)

    def new_step(self, budget: StopBudget) -> None:
        """Let stop_regex matching take at most what is left of `budget` (one character's
        steps more at most) until the next new_step; unbounded before the first. The budget
        may be shared with other requests: what one spends, the others no longer have."""
        if self._regex_stops is not None:
            self._regex_stops.budget = budget

    def catch_up(self) -> None:
        """Read on where stop_regex matching is behind (within the step's budget) and apply
        the rules of the tokens that waited for it, in order."""
        if self._waiting is not None:
            self._conclude()
        while self._held and self._waiting is None and not self.finished:
            self._take(*self._held.popleft())
        if self.finished:
            self._held.clear()

    def append(
        self,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
        forced: bool = False,
    ) -> None:
        """Record one token (sampled, or `forced` by the grammar) and apply the stop rules
        (after those of the tokens waiting for stop_regex matching, if any)."""
        if self.finished:
            raise RuntimeError("append() after the generation finished")
        if self.checking_stops:
            self._held.append((token_id, logprob, top_logprobs, forced))
            return
        self._take(token_id, logprob, top_logprobs, forced)

    def _take(
        self,
        token_id: int,
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None,
        forced: bool,
    ) -> None:
        """append() in its turn: record the token, then the stop rules."""
        if self.constraint is not None and not forced and not self.constraint.accept(token_id):
            raise RuntimeError(f"token {token_id} violates the request's constraint")
        params = self.params
        self.output_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
        self.sampler.observe(token_id)
        may_stop = len(self.output_ids) >= params.min_new_tokens
        if may_stop and token_id in self._stop_ids:
            self.finish("stop", matched=token_id)
            return
        hits = self._add_text(self._detok.step(token_id)) if self._detok is not None else []
        self._waiting = (token_id, hits)
        self._conclude()

    def _conclude(self) -> None:
        """The waiting token's stop rules, once stop_regex matching read its text (if the
        step's budget ends first: in a later catch_up())."""
        regex = self._regex_stops
        if regex is not None and not regex.advance():
            return
        token_id, hits = self._waiting
        self._waiting = None
        if regex is not None and (match := regex.match()) is not None:
            hits.append(match)
        if hits and len(self.output_ids) >= self.params.min_new_tokens:
            pos, end, stop = min(hits, key=lambda hit: hit[0])  # the earliest; ties: strings
            self.text = self.text[: end if self.params.include_stop_str_in_output else pos]
            self.finish("stop", matched=stop)
            return
        if self.constraint is not None and self.constraint.is_terminated:
            # the grammar admits nothing more: its end is the output's end, whatever
            # ignore_eos or min_new_tokens asked for
            self.finish("stop", matched=token_id)
            return
        if len(self.output_ids) >= self.params.max_new_tokens:
            self.finish("length")

    def jump_forward(self, max_tokens: int) -> int:
        """Append what the grammar forces next, at most `max_tokens` of it (the next step
        computes it as one extend); return how many tokens were forced."""
        if self.constraint is None or self.finished:
            return 0
        num_forced = 0
        for token_id in self.constraint.jump_forward(max_tokens):
            self.append(token_id, forced=True)
            num_forced += 1
            if self.finished:
                break
        return num_forced

    def finish(self, reason: str, matched: int | str | None = None) -> None:
        if self.finished:
            return
        self.finish_reason = reason
        self.matched_stop = matched
        self._held.clear()  # tokens after one whose rules wait: never in the output
        if self._waiting is not None:  # ended (abort, timeout) while stop matching was
            self.text = self.text[: self._checked_len()]  # behind: unchecked text is dropped
            self._waiting = None
        elif self._detok is not None and reason != "stop":
            self._add_text(self._detok.flush(), final=True)

    def stream_delta(self) -> str:
        """New text safe to show: text that can no longer turn out to start a stop string or
        a stop_regex match."""
        visible = len(self.text)
        if not self.finished:
            visible = min(visible - max(0, self._max_stop_len - 1), self._checked_len())
        if visible <= self._streamed_len:
            return ""
        delta = self.text[self._streamed_len : visible]
        self._streamed_len = visible
        return delta

    def take_new_outputs(self) -> range:
        """Indices of the output tokens not yet taken (for stream chunks); marks them taken."""
        new = range(self._chunked_len, len(self.output_ids))
        self._chunked_len = len(self.output_ids)
        return new

    def _checked_len(self) -> int:
        """Text that can no longer turn out to be part of a stop_regex match, nor follow a
        stop string found in a token whose rules wait."""
        checked = len(self.text)
        if self._regex_stops is not None:
            checked = min(checked, self._regex_stops.search_from)
        if self._waiting is not None:
            checked = min([checked, *(hit[0] for hit in self._waiting[1])])
        return checked

    def _add_text(self, delta: str, final: bool = False) -> list[StopHit]:
        """Extend the text by `delta`: the stop strings it completes (regex matchers begin
        reading it; _conclude() finishes); none when `final`."""
        if not delta:
            return []
        start = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        if final:
            return []
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        if self._regex_stops is not None:
            may_stop = len(self.output_ids) >= self.params.min_new_tokens
            self._regex_stops.begin(self.text, may_stop)
        return [(pos, pos + len(s), s) for pos, s in hits if pos >= 0]


class _RegexStops:
    """stop_regex over a growing text: the first non-empty match, and where one could still
    begin (text before that can be streamed). Each pattern runs as a linear-time automaton
    (runtime/stop_regex.py) fed only the new text, so a token costs the same whatever came
    before it and whatever the pattern; at most `budget` steps until the engine's next step
    (advance() says whether the text begun is read).

    Semantics are those of "the text so far contains a match": a pattern is checked after
    every token, so a greedy `\\d+` stops at the first digit and `end\\b` stops at "end" even
    if "ending" was coming.
    """

    def __init__(self, patterns: list[str]) -> None:
        self.budget = StopBudget(math.inf)  # automaton steps left in this engine step
        self.matchers: list[StopRegexMatcher] = []
        budget = MAX_PROGRAM_LEN  # all of a request's patterns together
        for pattern in patterns:
            matcher = StopRegexMatcher(pattern, max_len=budget)
            budget -= len(matcher.prog)
            self.matchers.append(matcher)

    @property
    def search_from(self) -> int:
        """No match can begin before this position any more."""
        return min(m.search_from for m in self.matchers)

    @property
    def num_steps(self) -> int:
        """Automaton steps taken so far, every pattern together (the matching's cost)."""
        return sum(m.num_steps for m in self.matchers)

    def begin(self, text: str, may_stop: bool) -> None:
        """Begin reading what `text` added since the last piece; before min_new_tokens it is
        passed over (matches must begin after the minimum)."""
        for matcher in self.matchers:
            new_text = text[matcher.num_fed :]
            if may_stop:
                matcher.begin(new_text)
            else:
                matcher.skip(new_text)

    def advance(self) -> bool:
        """Read on within the budget; True once every pattern read the piece."""
        for matcher in self.matchers:
            before = matcher.num_steps
            done = matcher.advance(self.budget.left)
            self.budget.left -= matcher.num_steps - before
            if not done:
                return False
        return True

    def match(self) -> StopHit | None:
        """The earliest match (start, end, pattern) in the piece read, if any."""
        hits = [(*m.found, m.pattern) for m in self.matchers if m.found is not None]
        return min(hits, key=lambda hit: hit[0]) if hits else None
