"""Wire types shared by flowlang and the engine, in-process and over HTTP. Pydantic; no torch."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_STOP_REGEX_COUNT = 32  # SGLang's limits, so a pattern it takes is taken here
MAX_STOP_REGEX_BYTES = 256
# a cache namespace (namespace, cache_salt and extra_key joined, with the API key's tag): every
# live one keeps its name in the tree; vLLM and SGLang set no limit, this one is generous
MAX_NAMESPACE_CHARS = 1024
# GraphHints bounds: advice about a program's future, never a claim on memory or time
MAX_HINT_FUTURE_TOKENS = 2**31 - 1
MAX_HINT_RETURN_S = 86_400.0  # a declared return later than a day is "not soon"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingParams(_Frozen):
    """How to pick each next token and when to stop. The only place these fields are declared.

    >>> SamplingParams(temperature=0, max_new_tokens=16).is_greedy
    True
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0, description="tokens to generate at most")
    min_new_tokens: int = Field(0, ge=0, description="EOS and stop ids are ignored before this")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 means no top-k restriction")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, description="HF-style, over prompt + output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, output only")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI-style, output only")
    seed: int | None = Field(
        None, ge=-(2**63), lt=2**64, description="per-request seed: same seed, same samples"
    )
    stop: list[str] = Field(
        default_factory=list, max_length=64, description="stop strings, cut from the text"
    )
    stop_token_ids: list[int] = Field(default_factory=list, max_length=1024)
    stop_regex: list[str] = Field(
        default_factory=list,
        description="stop once the text so far contains a non-empty match of one of these "
        "patterns; the match is cut from the text like a stop string",
    )
    ignore_eos: bool = False
    logit_bias: dict[int, float] = Field(
        default_factory=dict,
        description="token id -> a bias (-100..100) added to its logit before sampling, "
        "after penalties (OpenAI's logit_bias)",
    )
    include_stop_str_in_output: bool = Field(
        False, description="keep the matched stop string (or stop_regex match) in the text"
    )
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

    @field_validator("stop", "stop_regex", mode="before")
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

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex_compiles(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_REGEX_COUNT:
            raise ValueError(
                f"at most {MAX_STOP_REGEX_COUNT} stop_regex patterns, got {len(value)}"
            )
        for pattern in value:
            if not pattern or len(pattern.encode()) > MAX_STOP_REGEX_BYTES:
                raise ValueError(
                    f"stop_regex {pattern!r} must be 1 to {MAX_STOP_REGEX_BYTES} bytes long"
                )
            try:
                re.compile(pattern)  # syntax only: the engine runs it as an automaton
            except re.error as err:
                raise ValueError(f"invalid stop_regex {pattern!r}: {err}") from err
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_in_range(cls, value: dict[int, float]) -> dict[int, float]:
        bad = next(((t, b) for t, b in value.items() if t < 0 or not -100 <= b <= 100), None)
        if bad is not None:
            raise ValueError(
                f"logit_bias {{{bad[0]}: {bad[1]}}}: token ids are >= 0 and biases in -100..100"
            )
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
        # as SGLang and vLLM do: a temperature this small is greedy (dividing by it overflows)
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


CONSTRAINT_KINDS = ("regex", "json_schema", "choices", "grammar", "structural_tag")


class Constraint(_Frozen):
    """Structured output: exactly one of regex, JSON schema, choices, an EBNF grammar or an
    xgrammar structural tag (free text and tagged parts: tool calls, a reasoning block).

    The engine compiles it at submit (xgrammar) and masks every sampled token with it.
    """

    regex: str | None = None
    json_schema: dict | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | None = Field(
        None, description='xgrammar\'s structural tag JSON: {"type": "structural_tag", ...}'
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Constraint:
        given = [k for k in CONSTRAINT_KINDS if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"a constraint needs exactly one of {'/'.join(CONSTRAINT_KINDS)}, "
                f"got {given or 'none'}"
            )
        return self

    @property
    def kind(self) -> str:
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k))


TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class ToolSpec(_Frozen):
    """A function the model may call: its name, what it does, its arguments' JSON schema.

    >>> ToolSpec(name="clock").parameters
    {'type': 'object', 'properties': {}}
    """

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str = ""
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = Field(
        False,
        description="OpenAI's strict mode; calls are always constrained to the schema here",
    )


class ToolCall(_Frozen):
    """One call the model made: an id, the function's name, its arguments as a JSON text."""

    id: str
    name: str
    arguments: str = Field(description="a JSON object, as OpenAI sends function.arguments")


class GraphHints(_Frozen):
    """What the program graph knows about a request; the scheduler and eviction may use it.

    Hints are advice: the scheduler bounds what it does with them (future_tokens within the
    pool and its owner's share of it, returns within MAX_HINT_RETURN_S, branches remembered
    per owner), so no hint holds memory or another tenant's requests."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    program_id: str | None = Field(None, max_length=MAX_NAMESPACE_CHARS)
    branch_id: str | None = Field(None, max_length=MAX_NAMESPACE_CHARS)
    fork_group_id: str | None = Field(None, max_length=MAX_NAMESPACE_CHARS)
    fork_group_size: int | None = Field(None, ge=1)
    priority: int = Field(0, description="higher is scheduled (and kept in cache) first")
    continuation: bool = Field(
        False, description="the program has more work that extends this request's sequence"
    )
    next_turn_after_s: float | None = Field(
        None,
        ge=0,
        description="with continuation: the next request extending this sequence is expected "
        "this many seconds after this one finishes (a tool call's latency, a user's think "
        "time); the graph eviction policy keeps sooner returns longer. Unset: right away. "
        "Later than MAX_HINT_RETURN_S counts as MAX_HINT_RETURN_S",
    )
    waits_on_tools: bool = Field(
        False,
        description="with continuation: the next request extending this sequence waits for "
        "the calls this request makes to its tools (how long: next_turn_after_s when known). "
        "The program then grows by what no one knows ahead, and the program gate keeps room "
        "for it; unset, the next request is the program's own work, due when "
        "next_turn_after_s says",
    )
    future_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_HINT_FUTURE_TOKENS,
        description="with continuation: about how many tokens the program's later requests "
        "add to this sequence (their new prompt text and outputs); graph eviction keeps room "
        "for the work ahead to finish before it admits new work (at most the owner's share "
        "of the pool: a hint is advice, never a reservation)",
    )
    expected_output_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_HINT_FUTURE_TOKENS,
        description="about how many tokens this request will generate (Dynamo's `osl`): "
        "advice for what the scheduler would otherwise take from max_new_tokens (the growth "
        "it reserves for a running request, output-length ordering); never a limit: "
        "max_new_tokens still ends the request, and an estimate above it counts as it",
    )

    @model_validator(mode="after")
    def _waits_with_continuation(self) -> GraphHints:
        if self.waits_on_tools and not self.continuation:
            raise ValueError(
                "waits_on_tools needs continuation: true (the program goes on once its tools "
                "return)"
            )
        return self


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
    namespace: str | None = Field(
        None,
        description="cache salt: no sharing across namespaces; at most MAX_NAMESPACE_CHARS "
        "characters (checked at submit: an InvalidRequestError)",
    )
    timeout_s: float | None = Field(
        None, gt=0, description="abort the request this long after submit (queueing included)"
    )

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
    loaded_tokens: int = Field(
        0, description="of those, the ones loaded from host memory or disk (lower KV tiers)"
    )
    ttft_s: float | None = Field(
        None, description="seconds from submission to the first generated token"
    )
    queue_wait_s: float | None = Field(
        None, description="seconds from submission to its first admission (its queue wait)"
    )
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = Field(
        None, description="with prompt_logprobs and top_logprobs: the top-k at each position"
    )
    prompt_ids: list[int] | None = Field(None, description="with prompt_logprobs: their tokens")
    error: str | None = None
    error_kind: Literal["invalid", "busy", "internal", "timeout"] | None = Field(
        None,
        description="whose fault an error is: the request's, momentary load, ours, or its "
        "deadline (timeout_s) passing (finish_reason abort)",
    )


@dataclass(frozen=True, slots=True)
class StreamChunk:
    """What a running request produced since its previous chunk (a plain dataclass: one is
    made per generated token, on the engine's loop thread)."""

    text: str  # new text that can no longer be cut by a stop rule
    output_ids: list[int]  # tokens generated since the previous chunk
    num_output_tokens: int  # generated so far
    num_prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_ids, when asked
    # the prompt's logprobs (top-k, ids), when asked: in the first chunk only
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_ids: list[int] | None = None


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


class PinInfo(_Frozen):
    pin_id: str
    num_tokens: int
    cached_tokens: int = Field(description="tokens that were already cached when pinned")
    namespace: str | None = None
    held: bool = Field(
        True,
        description="False on an engine without a prefix cache: no request could reuse the "
        "prefix, so nothing was computed or locked (the handle still releases as usual)",
    )
