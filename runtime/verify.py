"""Sample and verify: a forward pass's logits become each request's new tokens.

The step is schedule -> forward -> `apply_logits` -> `Scheduler.process`: this stage is the
only one that reads logits (prompt logprobs, a scoring row, sampling), and the scheduler gets
back, per entry, what happened to its tokens.

A draft (drafts.py) of k guessed tokens is fed after a request's real tokens; the forward pass
returns k + 1 logit rows, row j predicting the token after the draft's first j tokens. They
are sampled in order, each exactly as a plain decode step would sample it (penalties, grammar
mask, temperature, the request's own generator: state advanced by the tokens before it), and
the run stops at the first sampled token that differs from the guess. So greedy output is the
plain one token for token, and sampled output has the plain distribution: with a guess that
is a single token x, "sample from p, keep going while it equals x" accepts x with probability
p(x) and otherwise yields p restricted to the other tokens, which is rejection sampling for a
one-point draft. A seeded request draws once per output token either way, so it reproduces.
Stop rules, min_tokens, logprobs and streaming are the GenerationState's, applied per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model.sampler import sample
from runtime.scheduler.entries import BatchEntry, ScheduledBatch
from runtime.scheduler.request import Req, ReqKind


@dataclass
class EntryOutcome:
    """What one entry's logits did."""

    at_end: bool = False  # its last real token was computed (else: a prefill chunk)
    sampled: bool = False  # tokens were appended to its output
    num_accepted: int = 0  # draft tokens that were right: their KV is kept
    num_forced: int = 0  # tokens a grammar forced after the sampled ones (jump-forward)
    prompt_logits: torch.Tensor | None = None  # (vocab,): after the whole prompt, just computed
    error: str | None = None
    error_kind: str = "invalid"


def apply_logits(
    batch: ScheduledBatch, logits: torch.Tensor | None, jump_forward: bool
) -> list[EntryOutcome]:
    """logits (num_logit_rows, vocab): the forward pass's rows in entry order (None without
    one) -> one outcome per entry. Entries that reuse kept logits come last, a row each.
    With `jump_forward`, a sampled token is followed by what the grammar forces next, at most
    the batch's max_forced_tokens of it (the rest follows next step)."""
    max_forced = batch.max_forced_tokens if jump_forward else 0
    reused = [e.req.reuse.logits for e in batch.entries if e.reuses_logits]
    if reused:
        kept = torch.stack(reused)  # (num_reused, vocab)
        logits = kept if logits is None else torch.cat([logits, kept.to(logits.device)])
    outcomes = [EntryOutcome() for _ in batch.entries]
    plain: list[tuple[Req, int, EntryOutcome]] = []  # sampled together: one row each
    row = 0
    for entry, outcome in zip(batch.entries, outcomes, strict=True):
        req = entry.req
        first_row, row = row, row + entry.num_logit_rows
        start = req.kv.num_computed
        if entry.all_logits:
            req.logprobs.record(req.prompt_ids, start, logits[first_row:row])
        outcome.at_end = start + entry.num_new >= req.num_tokens
        if not outcome.at_end:
            continue
        if req.kind is ReqKind.GENERATE:
            if entry.draft:
                _verify(entry, logits[first_row:row], outcome, max_forced)
            else:
                plain.append((req, row - 1, outcome))
                if entry.num_new and start + entry.num_new == len(req.prompt_ids):
                    outcome.prompt_logits = logits[row - 1]
        elif req.logprobs.keep_last:
            req.logprobs.last = torch.log_softmax(logits[row - 1].float().cpu(), dim=-1)
        elif req.kind is ReqKind.PIN and entry.wants_logits:
            outcome.prompt_logits = logits[row - 1]
    if plain:
        _sample_plain(plain, logits, max_forced)
    return outcomes


def _sample_plain(
    plain: list[tuple[Req, int, EntryOutcome]], logits: torch.Tensor, max_forced: int
) -> None:
    out = sample(logits[[r for _, r, _ in plain]], [req.gen.sampler for req, _, _ in plain])
    for i, (req, _, outcome) in enumerate(plain):
        if out.errors[i] is not None:
            outcome.error = out.errors[i]
            continue
        _append(req, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], outcome, max_forced)


def _verify(entry: BatchEntry, rows: torch.Tensor, outcome: EntryOutcome, max_forced: int) -> None:
    """rows (len(draft) + 1, vocab): sample in order, stop at the first miss."""
    gen, draft = entry.req.gen, entry.draft
    params = gen.sampler.params
    plain_greedy = (
        params.is_greedy
        and not params.needs_penalties
        and not params.logit_bias
        and gen.constraint is None
        and not (params.logprobs or params.top_logprobs)
    )
    argmax = rows.argmax(dim=-1).tolist() if plain_greedy else None
    for j in range(len(draft) + 1):
        if argmax is not None:
            token, logprob, top = argmax[j], None, None
        else:
            out = sample(rows[j : j + 1], [gen.sampler])
            if out.errors[0] is not None:
                outcome.error = out.errors[0]
                return
            token, logprob, top = out.token_ids[0], out.logprobs[0], out.top_logprobs[0]
        if not _append(entry.req, token, logprob, top, outcome, max_forced):
            return
        if j == len(draft) or token != draft[j]:
            return
        outcome.num_accepted += 1
        if gen.finished or outcome.num_forced or gen.checking_stops:
            return  # (stop matching behind: what follows waits for it)


def _append(
    req: Req,
    token: int,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    outcome: EntryOutcome,
    max_forced: int,
) -> bool:
    """One sampled token into the request's output (stop rules, grammar), then at most
    `max_forced` tokens the grammar forces after it; False on failure."""
    try:
        req.gen.append(token, logprob, top)
        if max_forced:
            outcome.num_forced += req.gen.jump_forward(max_forced)
    except Exception as err:  # noqa: BLE001 - this request's own failure, not the step's
        outcome.error, outcome.error_kind = f"output processing failed: {err}", "internal"
        return False
    outcome.sampled = True
    return True
