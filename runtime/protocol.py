"""Wire types shared by flowlang and the engine, in-process and over HTTP. Pydantic; no torch."""

from __future__ import annotations

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
