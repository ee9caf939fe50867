"""What a Req keeps, grouped by the feature that reads it.

`Req` (request.py) holds what the request is: its tokens, its generation, its kind and
callbacks. Each group here belongs to one part of the scheduler: where its KV lies (kv.py, the
cache), its place in the queue (admission.py, policy.py, shares.py), what it cost and saved
(results.py, the counters), the logits it reuses from an earlier identical prompt
(prompt_logits.py) and the prompt logprobs it asked for (verify.py, scoring.py). Speculation's
state is drafts.py's `SpecState`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from runtime.cache.nodes import EMPTY_SLOTS, TreePosition


@dataclass(eq=False)
class ReqKV:
    """Where a request's KV lies: `slots[i]` holds token i's for i < num_computed. The first
    `num_locked` slots belong to the radix tree (locked by the request at `lock_pos`); the
    rest of `slots` (whole pages) belong to the request until they are inserted or freed."""

    slots: torch.Tensor = EMPTY_SLOTS
    num_computed: int = 0  # tokens whose KV is in `slots`
    num_locked: int = 0  # tokens of those the tree holds for it
    lock_pos: TreePosition | None = None
    chunk_names: list[bytes] = field(default_factory=list)  # lower tiers' names (tiers.py)

    @property
    def capacity(self) -> int:
        """Slots it has (computed or not)."""
        return self.slots.numel()

    def reset(self) -> None:
        """Nothing computed, nothing held (after a retraction or a failed admission)."""
        self.slots = EMPTY_SLOTS
        self.num_computed = self.num_locked = 0
        self.lock_pos = None


@dataclass(eq=False)
class QueuePlace:
    """A request's place in the queue: the order it was admitted in, how often it went back,
    how often later requests passed it, and its last known cache match while it waits (the
    policy keeps `match_pos` current, at the tree's `match_version`)."""

    admit_seq: int = -1  # -1: never admitted
    num_retractions: int = 0
    num_passed: int = 0  # later requests admitted while this one was deferred
    # retracted to make room for another owner's request: it sits out the next admission pass
    # (a retracted request goes first, and would take back the room it was retracted for)
    yielded: bool = False
    match_pos: TreePosition | None = None
    match_version: int = -1
    # the engine's idle seconds (IdleTime) when it last joined the queue: how long the engine
    # has sat idle while it waited is the difference
    idle_at_arrival_s: float = 0.0

    @property
    def match_len(self) -> int:
        """Tokens of the last known cache match."""
        return self.match_pos.prefix_len if self.match_pos is not None else 0


@dataclass(eq=False)
class ReqUsage:
    """What a request saved and when it was served: its prompt tokens not computed at its
    first admission (cached in the pool, or of those loaded from the lower tiers), and its
    submission, first admission and first-token times (time.monotonic())."""

    submitted_s: float = field(default_factory=time.monotonic)
    admitted_s: float | None = None  # first set RUNNING (Req.status): its queue wait's end
    first_token_s: float | None = None
    cached_tokens: int | None = None  # at first admission; None before it
    loaded_tokens: int | None = None  # ... of those, loaded from host memory or disk
    loaded_now_tokens: int = 0  # loaded at this admission (counted into loaded_tokens once)


@dataclass(eq=False)
class LogitReuse:
    """The next-token logits after a request's whole prompt, kept from an earlier request with
    the same prompt (prompt_logits.py): its first token is sampled from them, nothing is
    computed. `prompt_key` names the prompt among the kept rows."""

    logits: torch.Tensor | None = None  # (vocab,) fp32
    prompt_key: bytes | None = None


@dataclass(eq=False)
class PromptLogprobs:
    """The prompt logprobs a request asked for: the logprob of token j (given the tokens
    before it) for every j >= `start`, the top-k at each of those positions when it asked for
    top logprobs, and (`keep_last`) the whole logprob row after its last position."""

    start: int | None = None  # None: none asked
    values: list[float | None] = field(default_factory=list)  # per prompt position
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    top_k: int = 0
    keep_last: bool = False
    last: torch.Tensor | None = None  # (vocab,) the kept row

    @classmethod
    def asked(
        cls, num_prompt: int, start: int | None, top_k: int, keep_last: bool
    ) -> PromptLogprobs:
        """Rows for a prompt of `num_prompt` tokens, unset; none when `start` is None."""
        if start is None:
            return cls(keep_last=keep_last)
        tops = [None] * num_prompt if top_k else []
        return cls(start, [None] * num_prompt, tops, top_k, keep_last)

    def record(self, prompt_ids: list[int], start: int, rows: torch.Tensor) -> None:
        """rows[i] are the logits at position start + i, predicting token start + i + 1."""
        logprobs = torch.log_softmax(rows.float().cpu(), dim=-1)  # (num_rows, vocab)
        first = max(0, self.start - start - 1)
        last = min(rows.shape[0], len(prompt_ids) - start - 1)
        if first >= last:
            return
        ids = torch.tensor(prompt_ids[start + first + 1 : start + last + 1])
        chosen = logprobs[first:last].gather(1, ids[:, None])[:, 0].tolist()
        self.values[start + first + 1 : start + last + 1] = chosen
        if self.tops:
            values, indices = logprobs[first:last].topk(self.top_k, dim=-1)  # (positions, k)
            tops = [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)
            ]
            self.tops[start + first + 1 : start + last + 1] = tops
