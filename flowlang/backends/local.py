"""LocalBackend: an in-process engine (runtime.engine), imported only when used."""

from __future__ import annotations

from typing import Any

from flowlang.backends.base import Backend, GenerationHandle, PinLease
from flowlang.chat import ChatFormat
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest, ScoreResult


class LocalBackend(Backend):
    """Runs programs on an in-process `runtime.engine.Engine`.

    >>> from runtime.engine import Engine  # doctest: +SKIP
    >>> backend = LocalBackend(Engine())  # doctest: +SKIP
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise ValueError("LocalBackend needs a model with a tokenizer")
        from flowlang.chat import CHATML

        self.chat_format = ChatFormat(
            tokenizer.chat_template or CHATML, tokenizer.bos_token or "", tokenizer.eos_token or ""
        )

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def generate(self, request: GenerateRequest) -> GenerationHandle:
        return self.engine.submit(request)

    def score(self, request: ScoreRequest) -> ScoreResult:
        return self.engine.score(request)[0]

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> PinLease:
        return self.engine.pin(prefix_ids, namespace, hints)

    def model_info(self) -> dict[str, Any]:
        arch = self.engine.arch
        return {
            "model": self.engine.config.model,
            "num_layers": arch.num_layers,
            "num_kv_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim,
            "dtype": self.engine.config.dtype,
        }

    def stats(self) -> dict[str, float]:
        return self.engine.stats()
