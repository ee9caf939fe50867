"""One chat completion's plan and its answer: the prompt (the chat template with tools and
history), the constraint (tool calls, a reasoning block, a response format), and how the
output becomes an assistant message (content, tool_calls, reasoning_content), whole or as
stream deltas.

Where the tool-call and reasoning formats come from: runtime/constrain/ (tool_calls.py,
reasoning.py, tool_prompt.py); the engine says which its model uses (Engine.tool_format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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

# template variables a request may not set through chat_template_kwargs
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "return_dict",
    }
)
_PROMPT_TAIL_TOKENS = 32  # enough of the prompt's end to see an opened reasoning block


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request runs and how its output is read back."""

    prompt_ids: list[int]
    constraint: Constraint | None
    tools: list[ToolSpec] = field(default_factory=list)  # whose calls are parsed (may be none)
    tool_format: ToolFormat | None = None  # None: no calls are parsed
    reasoning: ReasoningFormat | None = None  # None: the output is not split
    in_reasoning: bool = False  # the prompt opened the reasoning block itself
    keep_special_tokens: bool = False  # the call marker is a special token (Mistral's)


def plan_chat(engine: Any, body: ChatBody) -> ChatPlan:
    """The prompt and constraint for `body` on `engine`; bad messages or tools are a 400."""
    tokenizer = engine.tokenizer
    messages = [m.template_dict() for m in body.messages]
    check_unicode(json.dumps(messages, ensure_ascii=False))
    tools, choice = body.tool_specs(), body.choice()
    fmt = tool_format(engine.tool_format)
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {reserved}")
    if template_supports_tools(tokenizer.chat_template):
        rendered, tools_arg = template_messages(messages), openai_tools(tools) or None
    else:
        rendered, tools_arg = fallback_messages(messages, tools, fmt), None
    try:
        ids = tokenizer.apply_chat_template(
            rendered,
            tools=tools_arg,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=True,
            return_dict=True,
            **kwargs,
        )["input_ids"]
    except Exception as err:  # noqa: BLE001 - jinja raises many kinds; all are bad input
        raise InvalidRequestError(f"the chat template rejects these messages: {err}") from err
    ids = list(ids)
    thinks = engine.reasoning_format
    reasoning = reasoning_format(thinks) if thinks is not None else None
    in_reasoning = reasoning is not None and reasoning.in_reasoning(
        tokenizer.decode(ids[-_PROMPT_TAIL_TOKENS:])
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
