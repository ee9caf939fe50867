"""LocalBackend: an in-process engine (runtime.engine), imported only when used."""

from __future__ import annotations

import functools
import threading
from typing import Any

from flowlang.backends.base import Backend, GenerationHandle, PinLease
from flowlang.chat import CHATML, ChatFormat
from runtime.prefix import prefill_lower_bound, union_prefix_tokens
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest, ScoreResult


class LocalBackend(Backend):
    """Runs programs on an in-process `runtime.engine.Engine`.

    >>> from runtime.engine import Engine  # doctest: +SKIP
    >>> backend = LocalBackend(Engine())  # doctest: +SKIP
    """

    def __init__(self, engine: Any, record: bool = False) -> None:
        self.engine = engine
        self.record = record  # keep every request and result (reports, exact counts)
        self.generations: list[tuple[GenerateRequest, GenerationHandle]] = []
        self.scores: list[ScoreResult] = []
        self._log_lock = threading.Lock()
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("LocalBackend needs a model with a tokenizer")
        self.chat_format = ChatFormat(
            tokenizer.chat_template or CHATML, tokenizer.bos_token or "", tokenizer.eos_token or ""
        )

    @functools.cached_property
    def tool_format(self) -> str:  # read on first use; assignable, to override the engine's
        """How the engine's model writes tool calls."""
        return self.engine.tool_format

    @functools.cached_property
    def reasoning_format(self) -> str | None:
        """How the engine's model writes its reasoning, or None."""
        return self.engine.reasoning_format

    @property
    def model_name(self) -> str:
        """The model the engine runs (as configured)."""
        return self.engine.config.model

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def generate(self, request: GenerateRequest) -> GenerationHandle:
        handle = self.engine.submit(request)
        if self.record:
            with self._log_lock:
                self.generations.append((request, handle))
        return handle

    def score(self, request: ScoreRequest) -> ScoreResult:
        result = self.engine.score(request)[0]
        if self.record:
            with self._log_lock:
                self.scores.append(result)
        return result

    def prompt_report(self) -> dict[str, int]:
        """From the recorded requests: prompt tokens sent, unique (union prefix tree) and the
        prefill lower bound (unique minus KV computed while decoding). A scored
        continuation's last token needs no KV, so it is not counted."""
        with self._log_lock:
            generations, scores = list(self.generations), list(self.scores)
        prompts = [list(r.input_ids) for r, _ in generations]
        prompts += [s.prefix_ids + c[:-1] for s in scores for c in s.continuation_ids]
        finished = [(r.input_ids, h.result().output_ids) for r, h in generations]
        return {
            "requests": len(generations) + len(scores),
            "prompt_tokens": sum(map(len, prompts)),
            "unique_prompt_tokens": union_prefix_tokens(prompts),
            "lower_bound": prefill_lower_bound(prompts, finished),
        }

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinLease:
        return self.engine.pin(prefix_ids, namespace, hints)
