"""Wire types shared by flowlang and the engine, in-process and over HTTP. Pydantic; no torch."""

from __future__ import annotations

import uuid

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingParams(_Frozen):
    """How to pick each next token and when to stop. The only place these fields are declared.

    >>> SamplingParams(temperature=0, max_new_tokens=16).is_greedy
    True
    """

    max_new_tokens: int = Field(128, ge=0, description="tokens to generate at most")
    min_new_tokens: int = Field(0, ge=0, description="EOS and stop ids are ignored before this")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 means no top-k restriction")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF-style, over prompt + output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, output only")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, output only")
    seed: int | None = Field(None, description="per-request seed: same seed, same samples")
    stop: list[str] = Field(default_factory=list, description="stop strings, cut from the text")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = Field(False, description="return the logprob of each chosen token")
    top_logprobs: int = Field(0, ge=0, le=20, description="also the top-k alternatives per step")
    prompt_logprobs: bool = Field(False, description="logprobs of the prompt tokens computed")
    logprob_start_len: int | None = Field(
        None,
        ge=1,
        description="prompt logprobs from this position on (default 1); positions "
        "before it may come from the cache",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _min_below_max(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens={self.max_new_tokens}"
            )
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


class Constraint(_Frozen):
    """Structured output: exactly one of regex, JSON schema, choices or an EBNF grammar.

    The engine compiles it at submit (xgrammar) and masks every sampled token with it.
    """

    regex: str | None = None
    json_schema: dict | None = None
    choices: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> Constraint:
        given = [k for k in ("regex", "json_schema", "choices", "grammar") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"a constraint needs exactly one of regex/json_schema/choices/grammar, "
                f"got {given or 'none'}"
            )
        return self


class GraphHints(_Frozen):
    """What the program graph knows about a request; the scheduler and eviction may use it."""

    program_id: str | None = None
    branch_id: str | None = None
    fork_group_id: str | None = None
    fork_group_size: int | None = Field(None, ge=1)
    priority: int = Field(0, description="higher is scheduled (and kept in cache) first")
    continuation: bool = Field(
        False, description="the program has more work that extends this request's sequence"
    )


class GenerateRequest(_Frozen):
    """A prompt (text or token ids) and how to continue it.

    >>> GenerateRequest(text="Hello", sampling=SamplingParams(max_new_tokens=8)).rid is not None
    True
    """

    rid: str = Field(default_factory=lambda: uuid.uuid4().hex)
    text: str | None = None
    input_ids: list[int] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    hints: GraphHints = Field(default_factory=GraphHints)
    namespace: str | None = Field(None, description="cache salt: no sharing across namespaces")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


class TokenLogprob(_Frozen):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None = None


class GenerateResult(_Frozen):
    rid: str
    text: str
    output_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    prompt_tokens: int
    cached_tokens: int = Field(description="prompt tokens whose KV came from the cache")
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_ids: list[int] | None = Field(None, description="with prompt_logprobs: their tokens")
    error: str | None = None


class ScoreRequest(_Frozen):
    """A prefix and N continuations; each continuation's tokens are scored given the prefix."""

    prefix: str | list[int]
    continuations: list[str | list[int]] = Field(min_length=1)
    namespace: str | None = None
    hints: GraphHints = Field(default_factory=GraphHints)


class ScoreResult(_Frozen):
    prefix_ids: list[int]
    continuation_ids: list[list[int]]
    token_logprobs: list[list[float]]  # per continuation, one logprob per token

    @property
    def sums(self) -> list[float]:
        return [sum(lp) for lp in self.token_logprobs]

    @property
    def means(self) -> list[float]:
        return [sum(lp) / len(lp) for lp in self.token_logprobs]


class PinInfo(_Frozen):
    pin_id: str
    num_tokens: int
    cached_tokens: int = Field(description="tokens that were already cached when pinned")
    namespace: str | None = None
