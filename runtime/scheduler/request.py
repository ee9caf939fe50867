"""Req: the scheduler's view of one request (or pin): tokens, KV slots, locks, outputs."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from runtime.errors import InvalidRequestError
from runtime.generation import GenerationState
from runtime.protocol import MAX_NAMESPACE_CHARS, GraphHints
from runtime.scheduler.req_parts import LogitReuse, PromptLogprobs, QueuePlace, ReqKV, ReqUsage

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
    """Mutable per-request state owned by the scheduler thread: what the request is (tokens,
    generation, kind, callbacks, prompt logprobs) here, what each part of the scheduler keeps
    of it in its own group (req_parts.py: `kv`, `queue`, `usage`, `reuse`, `logprobs`; `spec`)."""

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
        self.logprobs = PromptLogprobs.asked(
            len(prompt_ids), logprob_start, gen.params.top_logprobs, keep_last_logprobs
        )
        self.on_delta = on_delta
        self.on_finish = on_finish
        self.error: str | None = None
        self.error_kind: str | None = None  # "invalid" | "busy" | "internal" | "timeout"
        # by feature (req_parts.py): where its KV lies, its place in the queue, what it cost
        # and saved, logits reused from an identical prompt, the prompt logprobs it asked for;
        # drafting state once it decodes
        self.kv = ReqKV()
        self.queue = QueuePlace()
        self.usage = ReqUsage()
        self.reuse = LogitReuse()
        self.spec: SpecState | None = None  # (drafts.py)
        self._status = ReqStatus.WAITING

    @property
    def status(self) -> ReqStatus:
        return self._status

    @status.setter
    def status(self, status: ReqStatus) -> None:
        # the first admission ends the queue wait (results' queue_wait_s, the request's span)
        if status is ReqStatus.RUNNING and self.usage.admitted_s is None:
            self.usage.admitted_s = time.monotonic()
        self._status = status

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
        if self.kind is ReqKind.GENERATE or self.logprobs.keep_last:
            first = end - 1  # to sample (or keep) the next token
        else:
            first = end  # nothing at the end
        if self.logprobs.start is not None:
            first = min(first, max(0, self.logprobs.start - 1))
        return first

    @property
    def match_limit(self) -> int:
        """Tokens that may come from the cache: every position whose logits we need is computed
        (all of them when the logits after the whole prompt are reused)."""
        if self.reuse.logits is not None:
            return self.num_tokens
        return min(self.num_tokens, self.first_logit_pos)

    @property
    def is_decoding(self) -> bool:
        """Prompt computed, output under way: each step feeds what was generated since (one
        sampled token, or more after a jump-forward)."""
        return bool(self.gen.output_ids) and self.kv.num_computed >= len(self.prompt_ids)

    @property
    def remaining_new_tokens(self) -> int:
        return max(0, self.gen.params.max_new_tokens - len(self.gen.output_ids))

    def __repr__(self) -> str:
        return (
            f"Req({self.rid[:8]}, {self.kind.value}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.kv.num_computed})"
        )


def check_namespace(namespace: str | None) -> None:
    """Refuse a cache namespace longer than MAX_NAMESPACE_CHARS: each live one keeps its name
    in the tree (and in the lower tiers' chunk names), so its length is memory."""
    if isinstance(namespace, str) and len(namespace) > MAX_NAMESPACE_CHARS:
        raise InvalidRequestError(
            f"the cache namespace is {len(namespace)} characters (namespace, cache_salt and "
            f"extra_key joined by '/', after the API key's tag); at most {MAX_NAMESPACE_CHARS}"
        )
