"""The backend contract: how flowlang reaches an engine (in-process, over HTTP, or a mock)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

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

    def place_batch(
        self, program: Any, batch: Sequence[Mapping[str, Any]], options: Mapping[str, Any]
    ) -> list | None:
        """Run a whole `program.run_batch` itself (a cluster placing instances on its
        replicas), results in batch order; None (the default): run it here."""
        return None
