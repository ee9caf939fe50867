"""One chat completion's plan and its answer: the prompt (the chat template with tools and
history), the constraint (tool calls, a reasoning block, a response format), and how the
output becomes an assistant message (content, tool_calls, reasoning_content), whole or as
stream deltas.

Where the tool-call and reasoning formats come from: runtime/constrain/ (tool_calls/,
reasoning.py, tool_prompt.py); the engine says which its model uses (Engine.tool_format).
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.constrain.reasoning import ReasoningFormat, ReasoningStream, reasoning_format
from runtime.constrain.tool_calls import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    InvalidTools,
    ToolCallStream,
    ToolFormat,
    output_constraint,
    template_supports_tools,
    tool_format,
)
from runtime.constrain.tool_prompt import fallback_messages, openai_tools, template_messages
from runtime.errors import InvalidRequestError
from runtime.intake import check_unicode
from runtime.protocol import Constraint, GenerateResult, ToolCall, ToolSpec
from runtime.server.schemas import ChatBody

if TYPE_CHECKING:
    from runtime.engine_api import EngineAPI

# what chat_template_kwargs may not set: the variables the server sets itself, and every
# argument of apply_chat_template (and of the renderer under it) that is no template variable:
# a template of the request's own, padding or truncation of the ids, tensors, tokenizer options
# (vLLM's GHSA-6fvq-23cw-5628). Extended at run time by the tokenizer's own signature.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
        "chat_template",
        "conversation",
        "conversations",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
MAX_TEMPLATE_KWARGS_CHARS = 65_536  # chat_template_kwargs as JSON: variables, not documents


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request runs and how its output is read back."""

    prompt_ids: list[int]
    constraint: Constraint | None
    tools: list[ToolSpec] = field(default_factory=list)  # whose calls are parsed (may be none)
    tool_format: ToolFormat | None = None  # None: no calls are parsed
    reasoning: ReasoningFormat | None = None  # None: the output is not split
    in_reasoning: bool = False  # the template's generation prompt opened the reasoning block
    keep_special_tokens: bool = False  # the call marker is a special token (Mistral's)


def plan_chat(engine: EngineAPI, body: ChatBody) -> ChatPlan:
    """The prompt and constraint for `body` on `engine`; bad messages or tools are a 400."""
    tokenizer = engine.tokenizer
    messages = [m.template_dict() for m in body.messages]
    check_unicode(json.dumps(messages, ensure_ascii=False))
    tools, choice = body.tool_specs(), body.choice()
    fmt = tool_format(engine.tool_format)
    kwargs = template_kwargs(tokenizer, body.chat_template_kwargs)
    if template_supports_tools(tokenizer.chat_template):
        rendered, tools_arg = template_messages(messages), openai_tools(tools) or None
    else:
        rendered, tools_arg = fallback_messages(messages, tools, fmt), None
    render = functools.partial(_render, tokenizer, rendered, tools_arg, kwargs)
    text = render(body.add_generation_prompt, body.continue_final_message)
    ids = _tokens(tokenizer, text)
    thinks = engine.reasoning_format
    reasoning = reasoning_format(thinks) if thinks is not None else None
    in_reasoning = reasoning is not None and reasoning.in_reasoning(
        _answer_prefix(render, text, body, messages)
    )
    budget = body.max_reasoning_tokens
    if budget is not None and reasoning is None:
        raise InvalidRequestError(
            "max_reasoning_tokens: this model writes no reasoning block (no reasoning format in "
            "its chat template; `flowlang serve --reasoning-parser` sets one)"
        )
    answer = body.answer_constraint()
    calls_wanted = bool(tools) and choice != "none"
    if calls_wanted and answer is not None:
        raise InvalidRequestError(
            "response_format (or regex/ebnf) with tools is not supported: the answer is either "
            "calls or free text; send tool_choice 'none' to constrain the text"
        )
    try:
        constraint = output_constraint(
            fmt, tools, choice, body.parallel_tool_calls, answer, reasoning, in_reasoning, budget
        )
    except InvalidTools as err:
        raise InvalidRequestError(f"tools: {err}") from err
    return ChatPlan(
        prompt_ids=ids,
        constraint=constraint,
        tools=tools if calls_wanted else [],
        tool_format=fmt if calls_wanted else None,
        reasoning=reasoning if body.separate_reasoning else None,
        in_reasoning=in_reasoning,
        keep_special_tokens=calls_wanted and _is_special_token(tokenizer, fmt.trigger),
    )


def template_kwargs(tokenizer: Any, requested: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, checked: only the template's own variables pass (a
    400 names any key that is an argument of the template call or of the tokenizer), and the
    whole is at most MAX_TEMPLATE_KWARGS_CHARS as JSON."""
    kwargs = dict(requested or {})
    refused = sorted(set(kwargs) & _refused_keys(type(tokenizer)))
    if refused:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {refused}: it passes the chat template's own "
            "variables only (these are arguments of the template call or of the tokenizer)"
        )
    try:
        text = json.dumps(kwargs, ensure_ascii=False)
    except (ValueError, RecursionError) as err:
        raise InvalidRequestError(f"chat_template_kwargs cannot be read: {err}") from err
    if len(text) > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequestError(
            f"chat_template_kwargs is {len(text)} characters as JSON; the limit is "
            f"{MAX_TEMPLATE_KWARGS_CHARS} (MAX_TEMPLATE_KWARGS_CHARS: template variables, "
            "not documents)"
        )
    check_unicode(text)
    return kwargs


@functools.cache
def _refused_keys(tokenizer_class: type) -> frozenset[str]:
    """_RESERVED_TEMPLATE_VARIABLES and every named parameter of this tokenizer's
    apply_chat_template (whatever its transformers version adds)."""
    method = getattr(tokenizer_class, "apply_chat_template", None)
    try:
        parameters = inspect.signature(method).parameters.values() if method else ()
    except (TypeError, ValueError):  # no signature to read: the fixed list alone
        parameters = ()
    named = {
        p.name
        for p in parameters
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    }
    return _RESERVED_TEMPLATE_VARIABLES | named


def _render(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None,
    kwargs: dict[str, Any],
    generation_prompt: bool,
    continue_final: bool,
) -> str:
    """The chat template's text for these messages; a template that fails is a 400."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )
    except Exception as err:  # noqa: BLE001 - jinja raises many kinds; all are bad input
        raise InvalidRequestError(f"the chat template rejects these messages: {err}") from err


def _tokens(tokenizer: Any, text: str) -> list[int]:
    """The prompt's ids, as apply_chat_template tokenizes its text (no special tokens added:
    the template wrote them)."""
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception as err:  # noqa: BLE001 - the tokenizer refuses text it cannot encode
        raise InvalidRequestError(f"the chat template's text cannot be tokenized: {err}") from err


def _answer_prefix(
    render: Callable[[bool, bool], str], text: str, body: ChatBody, messages: list[dict]
) -> str:
    """The text right before the answer that no user wrote, where an opened reasoning block
    is looked for: the template's generation prompt (the prompt past what the same messages
    render to without it), or a final assistant message being continued. Never the messages'
    own text: a user who writes `<think>` opens nothing."""
    if body.continue_final_message:
        last = messages[-1]
        content = last.get("content")
        return content if last.get("role") == "assistant" and isinstance(content, str) else ""
    if not body.add_generation_prompt:
        return ""
    return text[_common_prefix(render(False, False), text) :]


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common start of a and b (string compares in C: a
    prompt can be megabytes)."""
    if b.startswith(a):
        return len(a)
    low, high = 0, min(len(a), len(b))  # a[:low] == b[:low]; a[:high + 1] differ or end
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether `text` is one of the tokenizer's special tokens (which decoding would drop
    from the text, and the parser with it)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return any(t.special and t.content == text.strip() for t in added.values())


# ---------------------------------------------------------------------- the answer


def finish_reason(result: GenerateResult, called: bool = False) -> str:
    """OpenAI's finish_reason: length, tool_calls (a call ended the turn) or stop."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


def tool_call_json(call: ToolCall) -> dict:
    """A call as OpenAI's message.tool_calls entry."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def chat_message(plan: ChatPlan, result: GenerateResult) -> tuple[dict, str]:
    """The assistant message for a finished result, and its finish_reason."""
    text, reasoning = result.text, None
    if plan.reasoning is not None:
        reasoning, text = plan.reasoning.split(text, plan.in_reasoning)
    calls: list[ToolCall] = []
    if plan.tool_format is not None:
        parsed = plan.tool_format.parse(text, plan.tools)
        text, calls = parsed.content, parsed.calls
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message, finish_reason(result, bool(calls))


class ChatDeltas:
    """One choice's stream: text deltas in, OpenAI `delta` objects out (reasoning_content,
    content, tool_calls with index, id and name first, then argument fragments)."""

    def __init__(self, plan: ChatPlan) -> None:
        self._reasoning: ReasoningStream | None = (
            plan.reasoning.stream(plan.in_reasoning) if plan.reasoning is not None else None
        )
        self._calls: ToolCallStream | None = (
            plan.tool_format.stream(plan.tools) if plan.tool_format is not None else None
        )
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        """The deltas `text` (the next piece of output) makes."""
        pieces = self._reasoning.feed(text) if self._reasoning is not None else [("content", text)]
        return self._deltas(pieces)

    def finish(self) -> list[dict]:
        """The deltas held back until the output ended."""
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        deltas = self._deltas(pieces)
        if self._calls is not None:
            deltas += self._call_deltas(self._calls.finish())
        return deltas

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict]:
        deltas = []
        for kind, text in pieces:
            if not text:
                continue
            if kind == "reasoning":
                deltas.append({"reasoning_content": text})
            elif self._calls is None:
                deltas.append({"content": text})
            else:
                deltas += self._call_deltas(self._calls.feed(text))
        return deltas

    def _call_deltas(self, events: list) -> list[dict]:
        deltas = []
        for event in events:
            if isinstance(event, ContentDelta):
                if event.text:
                    deltas.append({"content": event.text})
            elif isinstance(event, CallStart):
                self.num_calls += 1
                start = {"name": event.name, "arguments": ""}
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": event.index, "id": event.id, "type": "function",
                             "function": start}
                        ]
                    }
                )  # fmt: skip
            elif isinstance(event, ArgumentsDelta):
                fragment = {"index": event.index, "function": {"arguments": event.text}}
                deltas.append({"tool_calls": [fragment]})
        return deltas
