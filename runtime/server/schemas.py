"""HTTP request bodies of the OpenAI API, mapped onto the protocol (SGLang's native bodies are
in sglang_schemas).

The OpenAI routes accept and ignore fields they do not know, as OpenAI's own clients send
extras.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runtime.errors import InvalidRequestError
from runtime.protocol import Constraint, SamplingParams
from runtime.server.errors import invalid_input


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class _OpenAISampling(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extensions vLLM also takes
    min_tokens: int = Field(0, ge=0)
    namespace: str | None = None  # flowlang extension: cache salt

    def sampling(
        self, max_tokens: int | None, index: int, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        """The engine's sampling parameters for choice `index`; values it rejects are a 400."""
        seed = None if self.seed is None else self.seed + index
        with invalid_input():
            return SamplingParams(
                max_new_tokens=max_tokens if max_tokens is not None else 256,
                temperature=self.temperature,
                top_p=self.top_p,
                stop=self.stop,
                seed=seed,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                ignore_eos=self.ignore_eos,
                min_new_tokens=self.min_tokens,
            )


class CompletionBody(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts as texts or token id lists; an empty list is a 400 (no choices)."""
        p = self.prompt
        if isinstance(p, list) and not p:
            raise InvalidRequestError("`prompt` is an empty list: send at least one prompt")
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ContentPart(_Lenient):
    """One part of a message's content; only text parts are understood."""

    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatBody(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None

    def constraint(self) -> Constraint | None:
        """The constraint response_format asks for, if any; a malformed one is a 400."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return Constraint(json_schema={"type": "object"})
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError("response_format json_schema needs a 'schema' object")
        with invalid_input():
            return Constraint(json_schema=schema)
