"""The backend contract: how flowlang reaches an engine (in-process, over HTTP, or a mock)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from flowlang.chat import ChatFormat
from runtime.protocol import GenerateRequest, GenerateResult, GraphHints, ScoreRequest, ScoreResult


class GenerationHandle(Protocol):
    """A running generation: iterate for text deltas, `result()` for the whole result."""

    def __iter__(self) -> Iterator[str]: ...

    def result(self) -> GenerateResult: ...


class PinLease(Protocol):
    def release(self) -> None: ...


class Backend(ABC):
    """Tokenizer, chat format and the engine calls a program needs.

    Thread-safe: many program states call it concurrently. `tool_format` and
    `reasoning_format` name how the model writes tool calls and reasoning
    (runtime/constrain/tool_calls.py, reasoning.py); a backend reads them off its engine.
    """

    chat_format: ChatFormat
    tool_format: str = "hermes"
    reasoning_format: str | None = None

    @abstractmethod
    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text` (special tokens written in the text are parsed as such)."""

    @abstractmethod
    def generate(self, request: GenerateRequest) -> GenerationHandle:
        """Start a generation; returns at once."""

    @abstractmethod
    def score(self, request: ScoreRequest) -> ScoreResult:
        """Per-token logprobs of each continuation after the prefix (prefix computed once)."""

    @abstractmethod
    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinLease:
        """Prefill the prefix once and keep it cached until the lease is released."""

    def plan_batch(self, instances: Sequence[BatchInstance], namespace: str | None) -> BatchPlan:
        """Where each compiled instance of a `run_batch` runs (a cluster places them on its
        replicas); by default all of them on this backend, as one group."""
        return BatchPlan((PlacedGroup(self, tuple(range(len(instances)))),))


@dataclass(frozen=True)
class BatchInstance:
    """One instance of a batch as placement sees it, from its compiled request graph."""

    prefix_ids: tuple[int, ...]  # what its first request sends (its later requests extend it)
    num_extra_tokens: int = 0  # what its later static requests add past that prefix


@dataclass(frozen=True)
class PlacedGroup:
    """Instances that run together on one backend, their shared prefixes pinned there."""

    backend: Backend
    indices: tuple[int, ...]  # positions in the batch, in batch order


@dataclass(frozen=True)
class BatchPlan:
    """A placement of a whole batch: every instance in exactly one group."""

    groups: tuple[PlacedGroup, ...]
