"""Batched sampling where every row has its own parameters, seed and penalties.

Order per row: penalties -> logit_bias -> grammar mask -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> draw with the row's own generator (so a seeded request reproduces
whatever it is batched with). Reported logprobs are of the model's raw distribution (before
penalties, logit_bias and temperature), which is what `select` scoring and OpenAI-style
logprobs mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from runtime.protocol import SamplingParams

NO_TOKEN = "no token can be sampled here (the constraint or the model left none)"
NO_DISTRIBUTION = (
    "the sampling parameters leave no valid distribution (temperature, penalties or "
    "top-k/top-p/min-p too extreme)"
)


@dataclass
class SamplerState:
    """One row's sampling parameters and running state: what `sample` reads, nothing else."""

    params: SamplingParams
    generator: torch.Generator | None = None  # seeded per request, else the engine's
    constraint: Any = None  # a ConstraintState (runtime.constrain.grammar) or None
    seen_mask: torch.Tensor | None = None  # (vocab,) bool: prompt + output tokens (penalties)
    output_counts: torch.Tensor | None = None  # (vocab,) float: output token counts (penalties)
    bias_ids: torch.Tensor | None = None  # (k,) int64: logit_bias's token ids
    bias_values: torch.Tensor | None = None  # (k,) float: what is added to their logits

    @classmethod
    def for_request(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        constraint: Any = None,
        default_generator: torch.Generator | None = None,
    ) -> SamplerState:
        """A fresh row: its own generator if seeded, penalty state if any penalty is set."""
        generator = default_generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(params.seed)
        state = cls(params, generator, constraint)
        if params.needs_penalties:
            state.seen_mask = torch.zeros(vocab_size, dtype=torch.bool)
            state.seen_mask[torch.as_tensor(list(prompt_ids), dtype=torch.int64)] = True
            state.output_counts = torch.zeros(vocab_size, dtype=torch.float32)
        if params.logit_bias:
            state.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.int64)
            state.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        return state

    def observe(self, token_id: int) -> None:
        """Count an output token (penalties)."""
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
            self.seen_mask[token_id] = True


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's raw logprob, for rows that asked
    top_logprobs: list[list[tuple[int, float]] | None]
    errors: list[str | None]  # per row: why it could not be sampled (the request fails alone)


def sample(logits: torch.Tensor, rows: Sequence[SamplerState]) -> SampleOutput:
    """logits (num_rows, vocab) fp32, one SamplerState per row -> next tokens.

    Logits on an accelerator stay there when no row asks for penalties, a constraint or
    logprobs (`sample_on_device`); otherwise they come over and are sampled here.
    """
    num_rows = logits.shape[0]
    if logits.device.type != "cpu":
        if all(_device_sampleable(r) for r in rows):
            return sample_on_device(logits, rows)
        logits = logits.cpu()
    want_logprobs = [r.params.logprobs or r.params.top_logprobs > 0 for r in rows]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

    logits = _adjusted(logits, rows)
    # a row fails alone: NaN logits, or a mask that leaves no token
    errors: list[str | None] = [None] * num_rows
    top = logits.amax(dim=-1)  # NaN where a row holds a NaN: amax propagates it
    for i in (torch.isnan(top) | (top == -torch.inf)).nonzero():
        errors[int(i)] = NO_TOKEN
    chosen = torch.zeros(num_rows, dtype=torch.int64)
    # a token the grammar forces is taken, not drawn: the row's generator then draws the same
    # numbers whether forced text comes by jump-forward (in chunks of any size) or token by token
    greedy = [i for i, r in enumerate(rows) if _takes_argmax(r) and errors[i] is None]
    if len(greedy) == num_rows:  # a batch of greedy rows: no copy of the logits
        chosen = logits.argmax(dim=-1)
    elif greedy:
        chosen[greedy] = logits[greedy].argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not _takes_argmax(r) and errors[i] is None]
    if sampled:
        probs = _filtered_probs(logits[sampled], [rows[i].params for i in sampled])
        valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)  # (num_sampled,)
        for j, i in enumerate(sampled):
            if not valid[j]:
                errors[i] = NO_DISTRIBUTION
                continue
            chosen[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]

    logprobs, tops = _logprobs_of(raw_logprobs, chosen, rows, want_logprobs)
    return SampleOutput(chosen.tolist(), logprobs, tops, errors)


def _takes_argmax(row: SamplerState) -> bool:
    """Greedy, or its grammar forces the next token (its mask left that one alone)."""
    return row.params.is_greedy or (row.constraint is not None and bool(row.constraint.forced()))


def _adjusted(logits: torch.Tensor, rows: Sequence[SamplerState]) -> torch.Tensor:
    """The logits after penalties, logit biases and constraints (a copy if any applies)."""
    penalized = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    biased = [i for i, r in enumerate(rows) if r.bias_ids is not None]
    constrained = [r.constraint for r in rows]
    if penalized or biased or any(c is not None for c in constrained):
        logits = logits.clone()
    if penalized:
        _apply_penalties(logits, penalized, rows)
    for i in biased:
        logits[i].index_add_(0, rows[i].bias_ids, rows[i].bias_values)
    if any(c is not None for c in constrained):
        from runtime.constrain.grammar import apply_constraints

        apply_constraints(logits, constrained)
    return logits


def _logprobs_of(
    raw_logprobs: torch.Tensor | None,
    chosen: torch.Tensor,
    rows: Sequence[SamplerState],
    want_logprobs: list[bool],
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """Each row's chosen token's raw logprob and its top alternatives, where it asks."""
    num_rows = len(rows)
    logprobs: list[float | None] = [None] * num_rows
    tops: list[list[tuple[int, float]] | None] = [None] * num_rows
    if raw_logprobs is None:
        return logprobs, tops
    picked = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    max_top = max(r.params.top_logprobs for r in rows)
    top_vals, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    for i, r in enumerate(rows):
        if want_logprobs[i]:
            logprobs[i] = picked[i]
        n = r.params.top_logprobs
        if n:
            tops[i] = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))
    return logprobs, tops


def _device_sampleable(row: SamplerState) -> bool:
    p = row.params
    return (
        not (p.logprobs or p.top_logprobs or p.needs_penalties or p.logit_bias)
        and row.constraint is None
    )


def sample_on_device(logits: torch.Tensor, rows: Sequence[SamplerState]) -> SampleOutput:
    """Greedy rows by argmax; the others by inverse CDF: one uniform per row from the row's
    own generator (on the host, so seeds work as on CPU) against the cumulative filtered
    probabilities. The same distribution as `torch.multinomial`, not the same draws."""
    num_rows = logits.shape[0]
    chosen = logits.argmax(dim=-1)  # (num_rows,)
    bad = torch.isnan(logits).any(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    invalid = torch.zeros(num_rows, dtype=torch.bool, device=logits.device)
    if sampled:
        probs = _filtered_probs(logits[sampled], [rows[i].params for i in sampled])
        uniforms = torch.stack([torch.rand((), generator=rows[i].generator) for i in sampled])
        chosen[sampled] = draw_by_cdf(probs, uniforms.to(logits.device))
        invalid[sampled] = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    token_ids, bad, invalid = chosen.tolist(), bad.tolist(), invalid.tolist()
    errors: list[str | None] = [None] * num_rows
    for i in range(num_rows):
        if bad[i]:
            errors[i] = NO_TOKEN
        elif invalid[i]:
            errors[i] = NO_DISTRIBUTION
    return SampleOutput(token_ids, [None] * num_rows, [None] * num_rows, errors)


def draw_by_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds uniforms[i] x the row's
    total (so a zero-probability token is never drawn). (n, vocab), (n,) -> (n,) int64."""
    cdf = probs.cumsum(dim=-1)  # (n, vocab)
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # (n, 1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Raw logprob of next_ids[j] under logits[j]: (n, vocab), (n,) -> (n,)."""
    return torch.log_softmax(logits, dim=-1).gather(1, next_ids[:, None].to(torch.int64))[:, 0]


def _apply_penalties(logits: torch.Tensor, rows_idx: list[int], rows) -> None:
    """Repetition (HF: divide positive / multiply negative logits of seen tokens), frequency
    and presence (OpenAI: subtract per output occurrence / once per output token)."""
    seen = torch.stack([rows[i].seen_mask for i in rows_idx])  # (n, vocab)
    counts = torch.stack([rows[i].output_counts for i in rows_idx])  # (n, vocab)
    params = [rows[i].params for i in rows_idx]
    rep = torch.tensor([p.repetition_penalty for p in params])[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params])[:, None]
    pres = torch.tensor([p.presence_penalty for p in params])[:, None]
    sub = logits[rows_idx]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits[rows_idx] = sub


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """(n, vocab) logits -> probabilities after temperature, top-k, top-p and min-p."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temps
    vocab = logits.shape[-1]
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in top_ks):
        kth = logits.topk(max(top_ks), dim=-1).values  # (n, max_k) descending
        ks = torch.tensor(top_ks, device=device)
        threshold = kth.gather(1, ks[:, None] - 1)
        threshold[ks == vocab] = float("-inf")
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    top_ps = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_ps < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_ps[:, None]  # keeps the smallest set reaching top_p
        drop_sorted[:, 0] = False  # the top token always stays (a top_p below fp32's range)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    min_ps = torch.tensor([p.min_p for p in params], device=device)[:, None]
    if bool((min_ps > 0).any()):
        probs = probs.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
