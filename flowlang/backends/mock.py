"""MockBackend: deterministic and model-free, for unit tests of programs.

Tokens are words (a word with its leading whitespace is one token; chat markers are single
tokens). A generation returns `max_new_tokens` (at most 4) words derived from a hash of the
prompt ids; a score gives each continuation token a deterministic logprob, or the value
configured in `choice_logprobs`. Every call is recorded for assertions.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from flowlang.backends.base import Backend
from flowlang.chat import CHATML, ChatFormat
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    ScoreRequest,
    ScoreResult,
)

_TOKEN = re.compile(r"<\|[a-z_]+\|>|\s*[^\s<]+|\s+|<")


@dataclass
class MockHandle:
    result_value: GenerateResult

    def __iter__(self) -> Iterator[str]:
        yield self.result_value.text

    def result(self) -> GenerateResult:
        return self.result_value


@dataclass
class MockPin:
    backend: MockBackend
    prefix_ids: list[int]
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            with self.backend._lock:
                self.backend.active_pins.remove(self)


@dataclass
class MockBackend(Backend):
    choice_logprobs: dict[str, float] = field(default_factory=dict)
    fail_on: str | None = None  # a generation whose prompt contains this text raises
    requests: list[GenerateRequest] = field(default_factory=list)
    score_requests: list[ScoreRequest] = field(default_factory=list)
    pins: list[MockPin] = field(default_factory=list)
    active_pins: list[MockPin] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.chat_format = ChatFormat(CHATML)
        self._vocab: dict[str, int] = {"<|im_end|>": 2}
        self._words: dict[int, str] = {2: "<|im_end|>"}
        self._lock = threading.Lock()

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        with self._lock:
            ids = []
            for piece in _TOKEN.findall(text):
                if piece not in self._vocab:
                    self._vocab[piece] = len(self._vocab) + 10
                    self._words[self._vocab[piece]] = piece
                ids.append(self._vocab[piece])
            return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self._words[i] for i in ids)

    def generate(self, request: GenerateRequest) -> MockHandle:
        with self._lock:
            self.requests.append(request)
        prompt = request.input_ids or self.tokenize(request.text or "")
        if self.fail_on and self.fail_on in self.decode(prompt):
            raise RuntimeError(f"mock backend refuses prompts containing {self.fail_on!r}")
        digest = hashlib.sha256(str(prompt).encode()).hexdigest()
        count = min(request.sampling.max_new_tokens, 4)
        text = "".join(f" w{digest[2 * i : 2 * i + 3]}" for i in range(count))
        ids = self.tokenize(text)
        return MockHandle(
            GenerateResult(
                rid=request.rid,
                text=text,
                output_ids=ids,
                finish_reason="length",
                prompt_tokens=len(prompt),
                cached_tokens=0,
                completion_tokens=len(ids),
            )
        )

    def score(self, request: ScoreRequest) -> ScoreResult:
        with self._lock:
            self.score_requests.append(request)
        prefix = (
            request.prefix if isinstance(request.prefix, list) else self.tokenize(request.prefix)
        )
        conts = [c if isinstance(c, list) else self.tokenize(c) for c in request.continuations]
        logprobs = []
        for cont in conts:
            text = self.decode(cont)
            if text in self.choice_logprobs:
                logprobs.append([self.choice_logprobs[text] / len(cont)] * len(cont))
            else:
                jitter = int(hashlib.sha256(text.encode()).hexdigest(), 16) % 7
                logprobs.append([-1.0 - jitter / 10 for _ in cont])
        return ScoreResult(prefix_ids=prefix, continuation_ids=conts, token_logprobs=logprobs)

    def pin(
        self, prefix_ids: list[int], namespace: str | None = None, hints: GraphHints | None = None
    ) -> MockPin:
        pin = MockPin(self, list(prefix_ids))
        with self._lock:
            self.pins.append(pin)
            self.active_pins.append(pin)
        return pin
