"""Req: the scheduler's view of one request (or pin): tokens, KV slots, locks, outputs."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from runtime.cache.nodes import TreePosition
from runtime.errors import InvalidRequestError
from runtime.generation import GenerationState
from runtime.protocol import MAX_NAMESPACE_CHARS, GraphHints

if TYPE_CHECKING:
    from runtime.scheduler.drafts import SpecState


class ReqKind(enum.Enum):
    GENERATE = "generate"  # prefill then decode until a stop rule fires
    PREFILL = "prefill"  # prefill only (max_new_tokens=0): scoring continuations
    PIN = "pin"  # prefill, then keep the prefix locked in the tree until unpinned


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PINNED = "pinned"
    FINISHED = "finished"


class Req:
    """Mutable per-request state owned by the scheduler thread.

    KV layout: `slots[i]` holds the KV of token i for i < num_computed. The first `num_locked`
    slots belong to the radix tree (locked by this request at `lock_pos`); the rest of `slots`
    (whole pages) belong to the request until they are inserted or freed.
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        gen: GenerationState,
        kind: ReqKind,
        namespace: str | None,
        hints: GraphHints,
        arrival: int,
        logprob_start: int | None = None,
        keep_last_logprobs: bool = False,
        on_delta: Callable[[Req], None] | None = None,
        on_finish: Callable[[Req], None] | None = None,
        deadline: float | None = None,
    ) -> None:
        check_namespace(namespace)
        self.rid = rid
        self.deadline = deadline  # time.monotonic() after which the request is aborted
        self.prompt_ids = prompt_ids
        self.gen = gen
        self.kind = kind
        self.namespace = namespace
        self.hints = hints
        self.arrival = arrival
        self.status = ReqStatus.WAITING
        # prompt logprobs: logprob of token j (given tokens < j) for every j >= logprob_start,
        # and the top-k at each of those positions when top_logprobs asks for it
        self.logprob_start = logprob_start
        self.prompt_logprobs, self.prompt_top_logprobs = _prompt_logprob_rows(
            len(prompt_ids), logprob_start, gen.params.top_logprobs
        )
        self.keep_last_logprobs = keep_last_logprobs  # full logprob row at the last position
        self.last_logprobs: torch.Tensor | None = None
        self.on_delta = on_delta
        self.on_finish = on_finish
        # KV state
        self.slots = _EMPTY
        self.num_computed = 0
        self.num_locked = 0
        self.lock_pos: TreePosition | None = None
        # accounting
        self.cached_tokens: int | None = None  # prefix hit at first admission
        self.num_loaded = 0  # this admission's tokens loaded from lower KV tiers, not computed
        self.loaded_tokens: int | None = None  # ... at first admission
        self.submitted_s = time.monotonic()
        self.first_token_s: float | None = None  # when its first token was sampled
        self.chunk_names: list[bytes] = []  # lower tiers' names of its chunks so far (tiers.py)
        self.admit_seq = -1
        self.num_retractions = 0
        self.num_passed = 0  # later requests admitted while this one was deferred
        self.error: str | None = None
        self.error_kind: str | None = None  # "invalid" | "busy" | "internal" | "timeout"
        # the last known cache match while waiting (SchedulePolicy.match keeps it current)
        self.match_pos: TreePosition | None = None
        self.match_version = -1
        self.spec: SpecState | None = None  # its drafting state, once it decodes (drafts.py)
        # the next-token logits after its whole prompt, kept from an earlier request with the
        # same prompt (prompt_logits.py): its first token is sampled from them, nothing computed
        self.reused_logits: torch.Tensor | None = None  # (vocab,) fp32
        self.prompt_key: bytes | None = None

    # ------------------------------------------------------------------ tokens
    @property
    def all_ids(self) -> list[int]:
        """Prompt plus generated tokens: what the KV must eventually cover (but the last)."""
        return self.prompt_ids + self.gen.output_ids if self.gen.output_ids else self.prompt_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building the whole concatenation (hot path)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.gen.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.gen.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.gen.output_ids)

    @property
    def first_logit_pos(self) -> int:
        """The earliest position whose next-token logits are needed."""
        end = self.num_tokens
        if self.kind is ReqKind.GENERATE or self.keep_last_logprobs:
            first = end - 1  # to sample (or keep) the next token
        else:
            first = end  # nothing at the end
        if self.logprob_start is not None:
            first = min(first, max(0, self.logprob_start - 1))
        return first

    @property
    def match_limit(self) -> int:
        """Tokens that may come from the cache: every position whose logits we need is computed
        (all of them when the logits after the whole prompt are reused)."""
        if self.reused_logits is not None:
            return self.num_tokens
        return min(self.num_tokens, self.first_logit_pos)

    @property
    def is_decoding(self) -> bool:
        """Prompt computed, output under way: each step feeds what was generated since (one
        sampled token, or more after a jump-forward)."""
        return bool(self.gen.output_ids) and self.num_computed >= len(self.prompt_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.gen.params.max_new_tokens - len(self.gen.output_ids))

    @property
    def match_len(self) -> int:
        """Tokens of the last known cache match."""
        return self.match_pos.prefix_len if self.match_pos is not None else 0

    @property
    def capacity(self) -> int:
        return self.slots.numel()

    def record_prompt_logprobs(self, start: int, rows: torch.Tensor) -> None:
        """rows[i] are the logits at position start + i, predicting token start + i + 1."""
        logprobs = torch.log_softmax(rows.float().cpu(), dim=-1)  # (num_rows, vocab)
        first = max(0, self.logprob_start - start - 1)
        last = min(rows.shape[0], len(self.prompt_ids) - start - 1)
        if first >= last:
            return
        ids = torch.tensor(self.prompt_ids[start + first + 1 : start + last + 1])
        chosen = logprobs[first:last].gather(1, ids[:, None])[:, 0].tolist()
        self.prompt_logprobs[start + first + 1 : start + last + 1] = chosen
        if self.prompt_top_logprobs:
            k = self.gen.params.top_logprobs
            values, indices = logprobs[first:last].topk(k, dim=-1)  # (num_positions, k)
            tops = [
                list(zip(row_ids, row_values, strict=True))
                for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)
            ]
            self.prompt_top_logprobs[start + first + 1 : start + last + 1] = tops

    def reset_kv(self) -> None:
        self.slots = _EMPTY
        self.num_computed = 0
        self.num_locked = 0
        self.lock_pos = None

    def __repr__(self) -> str:
        return (
            f"Req({self.rid[:8]}, {self.kind.value}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed})"
        )


_EMPTY = torch.empty(0, dtype=torch.int64)


def _prompt_logprob_rows(
    num_prompt: int, logprob_start: int | None, top_logprobs: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """A prompt's logprob per position and top-k per position, unset; [] when not asked."""
    if logprob_start is None:
        return [], []
    return [None] * num_prompt, [None] * num_prompt if top_logprobs else []


def check_namespace(namespace: str | None) -> None:
    """Refuse a cache namespace longer than MAX_NAMESPACE_CHARS: each live one keeps its name
    in the tree (and in the lower tiers' chunk names), so its length is memory."""
    if isinstance(namespace, str) and len(namespace) > MAX_NAMESPACE_CHARS:
        raise InvalidRequestError(
            f"the cache namespace is {len(namespace)} characters (namespace, cache_salt and "
            f"extra_key joined by '/', after the API key's tag); at most {MAX_NAMESPACE_CHARS}"
        )
