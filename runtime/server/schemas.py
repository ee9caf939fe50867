"""HTTP request bodies: SGLang's native /generate and the OpenAI API, mapped onto the protocol.

SGLang's native API is strict (unknown fields are a 422); the OpenAI routes accept and ignore
fields they do not know, as OpenAI's own clients send extras.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.errors import InvalidRequestError
from runtime.protocol import Constraint, SamplingParams
from runtime.server.errors import invalid_input


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------- SGLang native
class SGLangSamplingParams(_Strict):
    max_new_tokens: int = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = Field(None, alias="sampling_seed")
    regex: str | None = None
    json_schema: str | None = None  # a JSON string, as SGLang takes it
    ebnf: str | None = None
    n: int = Field(1, ge=1, le=1)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def to_protocol(
        self,
        logprobs: bool,
        top_logprobs: int,
        prompt_logprobs: bool,
        logprob_start_len: int | None,
    ) -> tuple[SamplingParams, Constraint | None]:
        """The engine's sampling parameters and constraint; values it rejects are a 400."""
        with invalid_input():
            params = SamplingParams(
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.min_new_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=max(0, self.top_k),
                min_p=self.min_p,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                repetition_penalty=self.repetition_penalty,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.no_stop_trim,
                seed=self.seed,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                prompt_logprobs=prompt_logprobs,
                logprob_start_len=logprob_start_len,
            )
        return params, constraint_of(
            regex=self.regex, json_schema=self.json_schema, grammar=self.ebnf
        )


class GenerateBody(_Strict):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    namespace: str | None = Field(None, description="cache salt")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)


# ---------------------------------------------------------------------- OpenAI
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
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


class ChatMessage(_Lenient):
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content)
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


def constraint_of(
    regex: str | None = None, json_schema: str | dict | None = None, grammar: str | None = None
) -> Constraint | None:
    """At most one constraint from SGLang-style fields (json_schema may be a JSON string)."""
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as err:
            raise InvalidRequestError(f"json_schema is not valid JSON: {err}") from err
    given = {
        k: v
        for k, v in (("regex", regex), ("json_schema", json_schema), ("grammar", grammar))
        if v is not None
    }
    if not given:
        return None
    with invalid_input():
        return Constraint(**given)
