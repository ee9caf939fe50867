"""HTTP request bodies of the OpenAI API, mapped onto the protocol (SGLang's native bodies are
in sglang_schemas).

Every field of OpenAI's chat/completions and completions requests is declared, as honoured,
ignored (billing and tracking metadata: no effect, logged) or unsupported (a 400 that names it
when set), as runtime/server/fields.py describes; the extensions vLLM and SGLang take
(top_k, min_p, chat_template_kwargs, separate_reasoning, regex, ebnf, vLLM's guided_* and
structured_outputs, ...) are declared the same way. A field neither API knows is a 422 that
names it: nothing we do not honour is silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from runtime.constrain.check import MAX_NESTING_DEPTH
from runtime.constrain.tool_prompt import arguments_nest_too_deep
from runtime.errors import InvalidRequestError
from runtime.protocol import TOOL_NAME_PATTERN, Constraint, GraphHints, SamplingParams, ToolSpec
from runtime.server.errors import invalid_input
from runtime.server.fields import AuditedFields, ignored_field, unsupported_field
from runtime.server.sglang_schemas import common_sampling_fields, structural_tag_of


class _OpenAIFields(AuditedFields):
    api_name = "OpenAI"


_METADATA = "tracking metadata for OpenAI's platform; it changes no output here"


class StreamOptions(_OpenAIFields):
    include_usage: bool = False
    include_obfuscation: bool = ignored_field("no obfuscation padding is sent", True)
    continuous_usage_stats: bool = unsupported_field("usage in every chunk", False)


class StructuredOutputs(_OpenAIFields):
    """vLLM's `structured_outputs`: one constraint on the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = Field(None, description="a JSON string: xgrammar's tag")
    disable_fallback: bool = ignored_field("one grammar backend (xgrammar), no fallback", False)
    disable_any_whitespace: bool = unsupported_field("whitespace control in JSON", False)
    disable_additional_properties: bool = unsupported_field(
        "closing JSON objects the schema leaves open", False
    )
    whitespace_pattern: str | None = unsupported_field("whitespace control in JSON")

    def given(self) -> dict[str, Any]:
        """The constraints this object sets, by field name."""
        values = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
            "structural_tag": self.structural_tag,
        }
        return {k: v for k, v in values.items() if v is not None}


# a constraint's field (the request's name for it) -> the protocol's Constraint kind
_CONSTRAINT_KINDS = {
    "regex": "regex",
    "ebnf": "grammar",
    "guided_regex": "regex",
    "guided_choice": "choices",
    "guided_json": "json_schema",
    "guided_grammar": "grammar",
    "structured_outputs.regex": "regex",
    "structured_outputs.choice": "choices",
    "structured_outputs.json": "json_schema",
    "structured_outputs.json_object": "json_schema",
    "structured_outputs.grammar": "grammar",
    "structured_outputs.structural_tag": "structural_tag",
}


def _json_value(value: dict | str, name: str) -> dict:
    """A schema given as an object or (as vLLM also takes it) a JSON text."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, RecursionError) as err:
        raise InvalidRequestError(f"{name} is not a JSON object: {err}") from err
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {type(parsed).__name__}")
    return parsed


class _OpenAISampling(_OpenAIFields):
    model: str | None = Field(
        None, description="the served model's id (as /v1/models lists it); another is a 404"
    )
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> a bias in -100..100 added to its logit"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the extensions vLLM and SGLang take
    top_k: int = Field(-1, ge=-1, description="-1 (or 0): no top-k restriction")
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    regex: str | None = None
    ebnf: str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_json: dict[str, Any] | str | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: str | None = ignored_field("one grammar backend: xgrammar")
    guided_whitespace_pattern: str | None = unsupported_field("whitespace control in JSON")
    spaces_between_special_tokens: bool = ignored_field(
        "vLLM passes it to decoding; the fast tokenizers flowlang serves ignore it, so either "
        "value gives the same text",
        True,
    )
    priority: int = Field(0, description="higher is scheduled (and kept in cache) first")
    # what the request's program is, from clients that are not flowlang programs (agent_hints)
    session_id: str | None = Field(
        None, description="SGLang's session id: the requests that share it are one program"
    )
    nvext: dict[str, Any] | None = Field(
        None, description="NVIDIA Dynamo's extension: agent_hints and agent_context"
    )
    hints: GraphHints | None = Field(
        None, description="flowlang's graph hints, as /v1/flowlang/generate takes them"
    )
    session_params: Any = unsupported_field("SGLang's sessions that rebuild the prompt")
    request_id: str | None = ignored_field("each choice gets its own engine id")
    namespace: str | None = Field(None, description="flowlang's cache salt")
    user: str | None = ignored_field(_METADATA)
    # vLLM features flowlang does not have
    bad_words: list[str] | None = unsupported_field("bad_words (use logit_bias)")
    logits_processors: Any = unsupported_field("custom logits processors")
    truncate_prompt_tokens: int | None = unsupported_field("prompt truncation")
    prompt_logprobs: int | None = unsupported_field(
        "prompt logprobs over the OpenAI API (SGLang's /generate returns them)"
    )
    allowed_token_ids: list[int] | None = unsupported_field(
        "allowed_token_ids (use logit_bias or a regex)"
    )
    return_tokens_as_token_ids: bool = unsupported_field("token ids as logprob tokens", False)
    return_token_ids: bool = unsupported_field("token ids in the response", False)
    kv_transfer_params: Any = unsupported_field("prefill/decode disaggregation")
    vllm_xargs: Any = unsupported_field("vLLM's custom extra arguments")
    cache_salt: str | None = Field(None, description="vLLM's name for namespace")

    def sampling(
        self, max_tokens: int, index: int, logprobs: bool, top_logprobs: int
    ) -> SamplingParams:
        """The engine's sampling parameters for choice `index`; values it rejects are a 400."""
        self.check_supported()
        if self.stream_options is not None:
            self.stream_options.check_supported("stream_options.")
        if self.structured_outputs is not None:
            self.structured_outputs.check_supported("structured_outputs.")
        seed = None if self.seed is None else self.seed + index
        with invalid_input():
            return SamplingParams(
                max_new_tokens=max_tokens,
                min_new_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                seed=seed,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                **common_sampling_fields(self),
            )

    def cache_namespace(self) -> str | None:
        """namespace and vLLM's cache_salt, joined (either keeps tenants' caches apart)."""
        return "/".join(s for s in (self.namespace, self.cache_salt) if s) or None

    def constraints_given(self) -> dict[str, Any]:
        """The constraint fields this request sets (regex, ebnf, vLLM's guided_* and
        structured_outputs), by name."""
        given = {
            "regex": self.regex,
            "ebnf": self.ebnf,
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "guided_json": self.guided_json,
            "guided_grammar": self.guided_grammar,
        }
        out = {k: v for k, v in given.items() if v is not None}
        if self.structured_outputs is not None:
            out |= {
                f"structured_outputs.{k}": v for k, v in self.structured_outputs.given().items()
            }
        return out

    def constraint(self, others: dict[str, bool] | None = None) -> Constraint | None:
        """The one constraint the request asks for, if any; two or more (with `others`, the
        route's own constraint fields that are set) are a 400 naming them."""
        given = self.constraints_given()
        named = sorted([*given, *(k for k, v in (others or {}).items() if v)])
        if len(named) > 1:
            raise InvalidRequestError(f"send at most one constraint; got {named}")
        if not given:
            return None
        ((name, value),) = given.items()
        kind = _CONSTRAINT_KINDS[name]
        if name == "structured_outputs.json_object":
            value = {"type": "object"}
        elif kind == "json_schema":
            value = _json_value(value, name)
        elif kind == "structural_tag":
            value = structural_tag_of(_json_value(value, name))
        with invalid_input():
            return Constraint(**{kind: value})

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False, description="the prompt's text before each choice's text")
    best_of: int | None = Field(
        None, ge=1, description="candidates per choice: only as many as n (each is returned)"
    )
    suffix: str | None = unsupported_field("insertion (a text after the completion)")
    add_special_tokens: bool = Field(
        True, description="a text prompt is tokenized with the model's special tokens (BOS)"
    )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as texts or token id lists; an empty list is a 400 (no choices)."""
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                f"best_of {self.best_of} with n {self.n}: picking the best of more candidates "
                "than are returned is not supported (send best_of equal to n, or leave it out)"
            )
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError(
                "echo with logprobs is not supported: the prompt's logprobs are not returned "
                "here (send echo or logprobs, not both)"
            )
        p = self.prompt
        if isinstance(p, list) and not p:
            raise InvalidRequestError("`prompt` is an empty list: send at least one prompt")
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


# ---------------------------------------------------------------------- messages


class TextPart(_OpenAIFields):
    """One part of a message's content; flowlang serves text-only models."""

    type: Literal["text"] = "text"
    text: str


class FunctionCallBody(_OpenAIFields):
    name: str
    arguments: str = Field(description="a JSON object, as OpenAI sends it")


class ToolCallBody(_OpenAIFields):
    """A call an earlier assistant message made."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ChatMessage(_OpenAIFields):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="the participant's name, given to the template")
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(
        None, description="an assistant turn's reasoning, given to templates that show it"
    )
    refusal: str | None = ignored_field("an earlier refusal; its content is what is shown")
    audio: Any = unsupported_field("flowlang serves text-only models")
    function_call: Any = unsupported_field("the deprecated functions API: send tool_calls")

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role!r}")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role!r}")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it."""
        self.check_supported(f"messages[{self.role}].")
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            for call in self.tool_calls:
                if arguments_nest_too_deep(call.function.arguments):
                    raise InvalidRequestError(
                        f"the arguments of an earlier call to {call.function.name!r} nest "
                        f"deeper than {MAX_NESTING_DEPTH} levels of objects and lists"
                    )
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


# ---------------------------------------------------------------------- tools


class FunctionDefinition(_OpenAIFields):
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(
        None, description="calls are always constrained to the schema here, strict or not"
    )


class ToolDefinition(_OpenAIFields):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_OpenAIFields):
    name: str


class NamedToolChoice(_OpenAIFields):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_OpenAIFields):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = Field(None, description="output is always constrained to the schema")


class ResponseFormat(_OpenAIFields):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class ChatBody(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    modalities: list[Literal["text"]] | None = None
    # the extensions vLLM and SGLang take
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the chat template (enable_thinking, ...)"
    )
    separate_reasoning: bool = Field(
        True, description="a reasoning model's thinking goes to reasoning_content"
    )
    max_reasoning_tokens: int | None = Field(
        None, ge=1, description="flowlang's: the reasoning block is closed after this many tokens"
    )
    add_generation_prompt: bool = Field(
        True, description="the template opens the assistant's turn after the messages"
    )
    continue_final_message: bool = Field(
        False, description="the last (assistant) message is left open and continued"
    )
    chat_template: str | None = unsupported_field(
        "a request's own chat template (the model's template is used)"
    )
    add_special_tokens: bool = unsupported_field(
        "special tokens on top of those the chat template writes", False
    )
    echo: bool = unsupported_field("echoing the last message in chat (use /v1/completions)", False)
    documents: Any = unsupported_field("documents for retrieval templates")
    mm_processor_kwargs: Any = unsupported_field("flowlang serves text-only models")
    # OpenAI fields with no meaning here, or for features flowlang does not have
    metadata: dict[str, str] | None = ignored_field(_METADATA)
    service_tier: str | None = ignored_field("one tier: every request is served alike")
    prompt_cache_key: str | None = ignored_field(
        "every shared prefix is cached anyway (namespace keeps tenants apart)"
    )
    prompt_cache_retention: str | None = ignored_field("the cache keeps what memory allows")
    prompt_cache_options: dict[str, Any] | None = ignored_field(
        "every shared prefix is cached anyway; the cache keeps what memory allows"
    )
    safety_identifier: str | None = ignored_field(_METADATA)
    store: bool | None = unsupported_field("stored completions", False)
    reasoning_effort: str | None = unsupported_field(
        "reasoning effort levels (use chat_template_kwargs, e.g. enable_thinking)"
    )
    verbosity: str | None = unsupported_field("verbosity levels")
    moderation: Any = unsupported_field("moderation")
    audio: Any = unsupported_field("flowlang serves text-only models")
    prediction: Any = unsupported_field("predicted outputs")
    web_search_options: Any = unsupported_field("web search")
    functions: Any = unsupported_field("the deprecated functions API: send tools")
    function_call: Any = unsupported_field("the deprecated functions API: send tool_choice")

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatBody:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: each function needs its own name, got {names}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"tools {names}"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs at least one function in tools")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError(
                "add_generation_prompt and continue_final_message: send one (continuing the "
                "last message opens no new turn)"
            )
        return self

    def tool_specs(self) -> list[ToolSpec]:
        """The functions offered, as the protocol's ToolSpec."""
        with invalid_input():
            return [
                ToolSpec(
                    name=t.function.name,
                    description=t.function.description or "",
                    parameters=t.function.parameters or {"type": "object", "properties": {}},
                    strict=bool(t.function.strict),
                )
                for t in self.tools or []
            ]

    def choice(self) -> str:
        """tool_choice as "auto", "none", "required" or a function's name (OpenAI's default:
        "auto" with tools, "none" without)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice or ("auto" if self.tools else "none")

    def answer_constraint(self) -> Constraint | None:
        """The constraint on the answer's text (response_format, regex, ebnf, vLLM's guided_*
        or structured_outputs), if any; two of them are a 400 that names them."""
        self.check_supported()
        fmt = self.response_format
        formatted = fmt is not None and fmt.type != "text"
        constraint = self.constraint({"response_format": formatted})
        if constraint is not None or not formatted:
            return constraint
        if fmt.type == "json_object":
            return Constraint(json_schema={"type": "object"})
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format json_schema needs a 'json_schema'")
        with invalid_input():
            return Constraint(json_schema=fmt.json_schema.schema_)
