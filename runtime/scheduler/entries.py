"""What one engine step computes: each request's part (`BatchEntry`) and the batch
(`ScheduledBatch`), and how a decoding or prefilling request's part is sized."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.model.batch import ForwardBatch
from runtime.scheduler.request import Req, ReqKind


@dataclass(frozen=True)
class BatchEntry:
    """One request's part of a step: `num_new` tokens after its `num_computed`."""

    req: Req
    num_new: int
    is_decode: bool
    all_logits: bool  # logits at every new position (prompt logprobs)
    wants_logits: bool  # logits at the last new position at least
    draft: tuple[int, ...] = ()  # guessed tokens fed after the real ones, to verify

    @property
    def reuses_logits(self) -> bool:
        """Nothing to compute: it samples from the logits kept after its whole prompt."""
        return self.num_new == 0 and not self.draft

    @property
    def num_logit_rows(self) -> int:
        if self.draft:
            return len(self.draft) + 1
        return self.num_new if self.all_logits else int(self.wants_logits)


@dataclass(frozen=True)
class ScheduledBatch:
    entries: list[BatchEntry]  # those that compute first (rows in order), then reused rows'
    forward: ForwardBatch | None  # None when every entry reuses kept logits
    # a jump-forward appends at most this many forced tokens a request (the step's token
    # budget: no more can be computed next step; appending thousands at once would take the
    # step's time in grammar and stop checks)
    max_forced_tokens: int


def batch_of(entries: list[BatchEntry], max_forced_tokens: int) -> ScheduledBatch:
    """The forward batch for `entries` (their slots are already allocated); entries that
    reuse kept logits compute nothing and go last."""
    computed = [e for e in entries if not e.reuses_logits]
    forward = None
    if computed:
        forward = ForwardBatch.build(
            [
                e.req.tokens(e.req.kv.num_computed, e.req.kv.num_computed + e.num_new)
                + list(e.draft)
                for e in computed
            ],
            [e.req.kv.slots[: e.req.kv.num_computed + e.num_new + len(e.draft)] for e in computed],
            logit_tails=[e.num_logit_rows for e in computed],
        )
    reused = [e for e in entries if e.reuses_logits]
    return ScheduledBatch(computed + reused, forward, max_forced_tokens)


def decode_entry(req: Req, budget: int) -> BatchEntry:
    """A decoding request's part of a step: the token it sampled, or after a jump-forward the
    forced tokens, at most the step's remaining prefill `budget` of them beyond one, so a long
    forced string is computed in chunks (one pass of thousands of tokens would hold every
    other request's step); it samples once they are all computed."""
    num_left = req.num_tokens - req.kv.num_computed
    num_new = min(num_left, 1 + max(0, budget - 1))
    return BatchEntry(req, num_new, True, False, num_new == num_left)


def decode_entries(decoding: list[Req], budget: int) -> tuple[list[BatchEntry], int]:
    """The decoding requests' parts of a step (decode_entry), and the prefill budget their
    forced tokens leave."""
    entries = []
    for req in decoding:
        entry = decode_entry(req, budget)
        budget -= entry.num_new - 1
        entries.append(entry)
    return entries, budget


def prefill_entry(req: Req, num_new: int, pin_row: bool) -> BatchEntry:
    end = req.kv.num_computed + num_new
    wants = end > req.first_logit_pos and (end == req.num_tokens or req.logprobs.start is not None)
    if pin_row and req.kind is ReqKind.PIN and end == req.num_tokens:
        wants = True  # the row after a pinned prefix, kept for branches that gen right there
    return BatchEntry(req, num_new, False, wants and req.logprobs.start is not None, wants)
