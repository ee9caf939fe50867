"""Drafts: a decoding request's guess of its next tokens, from what the engine already holds.

Three sources, the longest match of the request's last tokens wins (ties: the longer guess):
- its own context (prompt lookup: a quote, a repeated key, a list it continues);
- its program's siblings still running (fork branches answering the same question);
- the radix tree (TokenIndex): every cached prompt and finished answer of its namespace.

A guess is verified by the target model in the same step (verify.py), so a wrong one costs
only the extra rows of that forward pass. Each request adapts: its guess length follows how
much was accepted, and after a guess that missed entirely it waits 1, 3, 7, 15 steps before
guessing again, so a request with nothing to copy costs a lookup per step and little else.
And the length is capped by what the steps are measured to cost (step_costs.py): each guessed
token must be expected to add more than its share of the step's time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from runtime.cache.token_index import MAX_MATCH, NGRAM, TokenIndex
from runtime.scheduler.request import Req
from runtime.scheduler.step_costs import StepCosts

if TYPE_CHECKING:
    from runtime.config import EngineConfig
    from runtime.scheduler.entries import BatchEntry
    from runtime.scheduler.grammar_gate import GrammarGate
    from runtime.scheduler.kv import KVManager

FIRST_DRAFT_TOKENS = 4
MAX_COOLDOWN_STEPS = 15
MAX_SIBLINGS = 8  # running siblings a draft looks at
ACCEPT_DECAY = 0.9  # per verification: a request's acceptance follows its recent guesses
PRIOR_WEIGHT = 2.0  # a new request's acceptance starts as this many of everyone's guesses


class SpecState:
    """One request's drafting state: its own trigram index and how its guesses went."""

    __slots__ = ("grams", "indexed", "draft_len", "misses", "cooldown", "hits", "stops")

    def __init__(self, draft_len: int) -> None:
        self.grams: dict[tuple[int, int, int], int] = {}  # trigram -> where it last ended
        self.indexed = 0  # positions below this are in `grams`
        self.draft_len = draft_len
        self.misses = 0  # guesses in a row with nothing accepted
        self.cooldown = 0  # steps left without guessing
        self.hits = 0.0  # decayed: guessed tokens accepted
        self.stops = 0.0  # decayed: guesses cut short by a rejected token

    def alpha(self, prior: float) -> float:
        """Per-token acceptance: the chance the next guessed token is right, given the
        previous one was (geometric: accepted / (accepted + rejections))."""
        return (self.hits + PRIOR_WEIGHT * prior) / (self.hits + self.stops + PRIOR_WEIGHT)


def make_drafter(config: EngineConfig, index: TokenIndex | None) -> Drafter | NoDrafter:
    """The drafter `config.speculative` asks for (`index`: the tree's, None with the cache
    off)."""
    if config.speculative == "tree":
        return Drafter(config.spec_max_draft_tokens, index)
    return NoDrafter()


class NoDrafter:
    """Speculation off: no request gets a draft, and nothing is learned."""

    def draft(self, req: Req, running: Iterable[Req], num_decodes: int = 1) -> list[int]:
        return []

    def attach(self, entries: list[BatchEntry], running, grammar, kv) -> list[BatchEntry]:
        return entries

    def verified(self, req: Req, num_drafted: int, num_accepted: int) -> None:
        pass

    def observe_step(self, entries: Sequence[BatchEntry], seconds: float) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return Drafter(1, None).stats()  # the same series, all zero


class Drafter:
    """Picks each decoding request's draft and learns from its verification."""

    def __init__(self, max_draft_tokens: int, index: TokenIndex | None) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.index = index  # None: the radix cache is off
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.verified_drafts = 0
        self.costs = StepCosts()
        self._hits = self._stops = 1.0  # everyone's, decayed: new requests' prior

    def attach(
        self, entries: list[BatchEntry], running: list[Req], grammar: GrammarGate, kv: KVManager
    ) -> list[BatchEntry]:
        """The decode entries with each request's guess of what follows, where it has one,
        its grammar allows it and free slots hold it (a guess never evicts anything)."""
        attached = []
        for entry in entries:
            req = entry.req
            draft = self.draft(req, running, len(entries)) if entry.wants_logits else []
            draft = draft[: grammar.max_draft_tokens(req, len(draft))] if draft else draft
            if draft and kv.grow(req, req.num_tokens + len(draft), evict=False):
                entry = replace(entry, draft=tuple(draft))
            attached.append(entry)
        return attached

    def draft(self, req: Req, running: Iterable[Req], num_decodes: int = 1) -> list[int]:
        """Up to the request's draft length of guessed tokens, in a step of `num_decodes`
        decoding requests; [] to decode plainly."""
        state = self._state(req)
        if state.cooldown:
            state.cooldown -= 1
            return []
        limit = min(state.draft_len, req.remaining_new_tokens - 1)
        prior = self._hits / (self._hits + self._stops)
        worth = self.costs.worth(num_decodes, state.alpha(prior), limit)
        if worth == 0 and limit > 0:  # not worth it now: one token now and then, to re-learn
            state.cooldown = MAX_COOLDOWN_STEPS
            worth = 1
        limit = worth
        n = req.num_tokens
        if limit <= 0 or n < NGRAM:
            return []
        tail = self._tail(req)
        found = self._context_guesses(req, running, tail, limit)
        if self.index is not None:
            found.append(self.index.continuation(req.namespace, tail, limit))
        best_len, best = 0, []
        for matched, guess in found:
            if (matched, len(guess)) > (best_len, len(best)):
                best_len, best = matched, guess
        return best

    def candidates(self, req: Req, running: Iterable[Req], max_tokens: int) -> list[list[int]]:
        """Every guess the sources hold for `req` now (its own context, each sibling, each
        matching tree position), not only the best: what a token tree would verify."""
        if req.num_tokens < NGRAM:
            return []
        tail = self._tail(req)
        found = self._context_guesses(req, running, tail, max_tokens)
        if self.index is not None:
            found += self.index.guesses(req.namespace, tail, max_tokens, limit=32)
        return [guess for _, guess in found if guess]

    def _tail(self, req: Req) -> list[int]:
        self._state(req)
        _index_upto(req, req.num_tokens - 1)
        return req.tokens(max(0, req.num_tokens - MAX_MATCH), req.num_tokens)

    def _context_guesses(
        self, req: Req, running: Iterable[Req], tail: list[int], limit: int
    ) -> list[tuple[int, list[int]]]:
        """(matched, guess) from the request's own tokens and its running siblings'."""
        found = [_lookup(req, tail, limit)]
        program = req.hints.program_id
        if program is not None:
            siblings = (
                r
                for r in running
                if r is not req and r.hints.program_id == program and r.namespace == req.namespace
            )
            for _, sibling in zip(range(MAX_SIBLINGS), siblings, strict=False):
                self._state(sibling)
                _index_upto(sibling, sibling.num_tokens - 1)  # as its own drafts index it
                found.append(_lookup(sibling, tail, limit))
        return found

    def _state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(min(FIRST_DRAFT_TOKENS, self.max_draft_tokens))
        return req.spec

    def verified(self, req: Req, num_drafted: int, num_accepted: int) -> None:
        """A draft of `num_drafted` tokens was verified and `num_accepted` kept."""
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.verified_drafts += 1
        state = req.spec
        stopped = float(num_accepted < num_drafted)
        state.hits = state.hits * ACCEPT_DECAY + num_accepted
        state.stops = state.stops * ACCEPT_DECAY + stopped
        self._hits = self._hits * ACCEPT_DECAY + num_accepted
        self._stops = self._stops * ACCEPT_DECAY + stopped
        if num_accepted == num_drafted:
            state.draft_len = min(self.max_draft_tokens, state.draft_len * 2)
        else:
            state.draft_len = max(1, num_accepted + 1)
        if num_accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.cooldown = min(MAX_COOLDOWN_STEPS, (1 << state.misses) - 1)

    def observe_step(self, entries: Sequence[BatchEntry], seconds: float) -> None:
        """A step's forward + sample/verify time: pure decode steps teach what guessed
        tokens cost."""
        if all(e.is_decode for e in entries):
            extra = sum(len(e.draft) + e.num_new - 1 for e in entries)
            self.costs.observe(len(entries), extra, seconds)

    def stats(self) -> dict[str, float]:
        drafts = self.verified_drafts
        return {
            "spec_drafts_total": drafts,
            "spec_draft_tokens_total": self.drafted_tokens,
            "spec_accepted_tokens_total": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.drafted_tokens
            if self.drafted_tokens
            else 0.0,
            # tokens a verifying step appends per request: the accepted guesses plus one
            "spec_mean_accepted_length": (self.accepted_tokens + drafts) / drafts
            if drafts
            else 0.0,
        }


def _index_upto(req: Req, end: int) -> None:
    """Index the trigrams of `req` ending below `end` (incrementally)."""
    state = req.spec
    if state is None:
        return
    start = state.indexed
    if end <= start:
        return
    first = max(start, NGRAM - 1)
    ids = req.tokens(first - NGRAM + 1, end)
    grams = state.grams
    for i in range(len(ids) - NGRAM + 1):
        grams[(ids[i], ids[i + 1], ids[i + 2])] = first + i
    state.indexed = end


def _lookup(source: Req, tail: list[int], limit: int) -> tuple[int, list[int]]:
    """What followed the last trigram of `tail` in `source`'s tokens: (match length, guess)."""
    state = source.spec
    if state is None:
        return 0, []
    end = state.grams.get((tail[-3], tail[-2], tail[-1]))
    if end is None:
        return 0, []
    before = source.tokens(max(0, end + 1 - len(tail)), end + 1)
    matched = 0
    while matched < len(before) and before[-1 - matched] == tail[-1 - matched]:
        matched += 1
    guess = source.tokens(end + 1, min(end + 1 + limit, source.num_tokens))
    return (matched, guess) if guess else (0, [])
