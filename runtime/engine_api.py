"""The engine's surface, declared: what the HTTP server (runtime/server/), a replica
(runtime/cluster/replica.py) and the in-process backend (flowlang/backends/local.py) use of an
engine (`EngineAPI`). `Engine` (runtime/engine.py) and the router front `ClusterEngine`
(runtime/cluster/front.py) both implement it, so the server serves either; `EngineCommon` holds
the members the two compute alike. tests/test_engine_api.py checks that both provide every
member and that serving code reads nothing else of its engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from runtime.constrain.formats import model_reasoning_format, model_tool_format
from runtime.errors import InvalidRequestError
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    PinInfo,
    ScoreRequest,
    ScoreResult,
)
from runtime.results import error_result

if TYPE_CHECKING:
    from runtime.cache.chunks import TierView
    from runtime.cache.events import KVEvent, KVSnapshot
    from runtime.cache.view import CacheView
    from runtime.config import EngineConfig
    from runtime.handles import RequestHandle
    from runtime.intake import RequestIntake
    from runtime.model.arch import ModelArch
    from runtime.scoring import Cancellation
    from runtime.summary import EngineSummary


class HeldPin(Protocol):
    """A pinned prefix (runtime.handles.PinHandle, runtime.cluster.cluster.ClusterPin)."""

    info: PinInfo
    pin_id: str

    def release(self) -> None:
        """Unlock the prefix (once; later calls do nothing)."""


class EventStream(Protocol):
    """A KV event subscription (runtime.cache.events, runtime.cluster.event_reader)."""

    snapshot: KVSnapshot

    @property
    def closed(self) -> bool:
        """Whether it ended (closed, or its engine stopped)."""

    def poll(self, timeout_s: float = 0.0) -> list[KVEvent]:
        """The pending events, waiting up to `timeout_s` for the first."""

    def close(self) -> None:
        """End the subscription."""


class EngineAPI(Protocol):
    """What serving code may use of an engine; thread-safe, every member."""

    config: EngineConfig  # every setting (read-only)
    arch: ModelArch  # what the engine read of the model's config
    tokenizer: Any  # the model's tokenizer (Hugging Face), None for random weights

    # ---------------------------------------------------------------- the model
    @property
    def num_slots(self) -> int:
        """KV pool size in token slots (one replica's, behind a front)."""

    @property
    def caches_prefixes(self) -> bool:
        """Whether computed prefixes are reused (False with disable_radix_cache)."""

    @property
    def tool_format(self) -> str:
        """How the model writes tool calls: configured, or read off its chat template."""

    @property
    def reasoning_format(self) -> str | None:
        """How the model writes its reasoning, or None."""

    def tokens(self, text_or_ids: str | list[int], special: bool) -> list[int]:
        """Token ids of a text (or the ids themselves); InvalidRequestError without tokenizer."""

    def validate_ids(self, ids: list[int], what: str) -> None:
        """InvalidRequestError naming the first id (`what`) outside the vocabulary."""

    def compile_ahead(self, requests: list[GenerateRequest], tenant: str) -> list[Future]:
        """Compile the requests' new constraints on `tenant`'s turn of the compile queue."""

    # ---------------------------------------------------------------- work
    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        """Queue a request, returning at once; InvalidRequestError for an invalid one."""

    def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest]
    ) -> list[GenerateResult]:
        """Run requests to completion; an invalid one gets an "error" result."""

    def score(
        self,
        requests: ScoreRequest | Sequence[ScoreRequest],
        cancel: Cancellation | None = None,
    ) -> list[ScoreResult]:
        """Per-token logprobs of each continuation after its prefix; `cancel` stops them."""

    def pin(
        self, prefix: str | list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> HeldPin:
        """Compute a prefix (once) and keep it cached until the handle is released."""

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request (nothing if it finished)."""

    def flush_cache(self) -> int:
        """Evict every unlocked cached token; how many were evicted."""

    # ---------------------------------------------------------------- state
    def stats(self) -> dict[str, float]:
        """Counters and gauges (Prometheus-style names)."""

    def summary(self) -> EngineSummary:
        """What the engine is (the startup lines)."""

    def cache_view(self, max_nodes: int = 40) -> CacheView:
        """The radix tree, summarised to about `max_nodes` nodes."""

    def subscribe_kv_events(
        self, max_pending_events: int = 100_000, replica: int | None = None
    ) -> EventStream:
        """The KV cache's events (snapshot first); `replica`: whose, behind a front."""

    def tier_view(self) -> TierView | None:
        """How the KV tiers below the pool name chunks; None without a disk tier."""

    def check_integrity(self) -> None:
        """Assert the tree, allocator and scheduler invariants (tests, checks)."""

    # ---------------------------------------------------------------- lifetime
    @property
    def is_alive(self) -> bool:
        """Whether it can serve (its loop runs; behind a front, some replica does)."""

    @property
    def closed(self) -> bool:
        """Whether close() was called."""

    @property
    def fatal_error(self) -> str | None:
        """Why it can no longer serve, if it cannot."""

    def close(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, drain for up to `drain_timeout` seconds, abort the rest, stop."""


class EngineCommon:
    """The members of EngineAPI that Engine and ClusterEngine compute alike: from the config,
    the tokenizer and the request intake (each validates requests itself), and from `submit`
    and each one's `_score_one`."""

    config: EngineConfig
    tokenizer: Any
    intake: RequestIntake

    @property
    def num_slots(self) -> int:
        """The KV pool's size in token slots (one replica's: a request runs on one)."""
        return self.intake.num_slots

    def tokens(self, text_or_ids: str | list[int], special: bool) -> list[int]:
        """Token ids of a text (or the ids themselves), as a request's prompt is read."""
        return self.intake.tokens(text_or_ids, special)

    def validate_ids(self, ids: list[int], what: str) -> None:
        """Every id must name a token of the vocabulary (InvalidRequestError names `what`)."""
        self.intake.validate_ids(ids, what)

    def compile_ahead(self, requests: list[GenerateRequest], tenant: str) -> list[Future]:
        """Compile the requests' new constraints on the compile queue before they are
        submitted, where `submit` validates them (runtime/intake.py)."""
        return self.intake.compile_ahead(requests, tenant)

    @property
    def caches_prefixes(self) -> bool:
        """Whether KV a pin or a finished request computed is reused by later requests (False
        with disable_radix_cache: every request computes its whole prompt)."""
        return not self.config.disable_radix_cache

    @property
    def tool_format(self) -> str:
        """How this model writes tool calls: configured, or read off the chat template."""
        return model_tool_format(self.config, self.tokenizer)

    @property
    def reasoning_format(self) -> str | None:
        """How this model writes its reasoning, or None."""
        return model_reasoning_format(self.config, self.tokenizer)

    def generate(
        self, requests: GenerateRequest | Sequence[GenerateRequest]
    ) -> list[GenerateResult]:
        """Run requests to completion: every one is queued before the first result is
        awaited. An invalid one yields a result with finish_reason "error" and its message in
        `error`; the others run normally."""
        if isinstance(requests, GenerateRequest):
            requests = [requests]
        handles: list[RequestHandle | GenerateResult] = []
        for request in requests:
            try:
                handles.append(self.submit(request))
            except InvalidRequestError as err:
                handles.append(error_result(request.rid, str(err)))
        return [h if isinstance(h, GenerateResult) else h.result() for h in handles]

    def score(
        self,
        requests: ScoreRequest | Sequence[ScoreRequest],
        cancel: Cancellation | None = None,
    ) -> list[ScoreResult]:
        """Per-token logprobs of each continuation after its prefix (prefix computed once);
        `cancel` stops the scoring (ScoreCancelled)."""
        if isinstance(requests, ScoreRequest):
            requests = [requests]
        self._check_open()
        return [self._score_one(request, cancel) for request in requests]

    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None = None
    ) -> RequestHandle:
        raise NotImplementedError  # each engine's own

    def _score_one(self, request: ScoreRequest, cancel: Cancellation | None) -> ScoreResult:
        raise NotImplementedError  # each engine's own

    def _check_open(self) -> None:
        raise NotImplementedError  # each engine's own: EngineClosedError once closed
