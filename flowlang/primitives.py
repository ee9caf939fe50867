"""What programs write: gen, select, roles, few-shot blocks. Each returns IR nodes; nothing runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2

from flowlang.errors import ProgramError
from flowlang.gen_args import (
    constraint_of,
    given_constraint,
    offered_tools,
    sampling_params,
    thinking_args,
)
from flowlang.ir import (
    Gen,
    Node,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    ToolOutput,
    ToolResult,
)
from flowlang.selection import METHODS, ChoicesMethod, method_name
from flowlang.tools import Call, Tool, as_tools, result_text
from runtime.protocol import ToolCall

INT_REGEX = r"-?(0|[1-9][0-9]{0,17})"
FLOAT_REGEX = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?"


def gen(
    name: str | None = None,
    *,
    regex: str | None = None,
    schema: type | dict | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
    next_turn_after_s: float | None = None,
    tools: Sequence[Any] | None = None,
    tool_choice: str | Tool = "auto",
    parallel_tool_calls: bool = True,
    reasoning: bool | str = False,
    max_reasoning_tokens: int | None = None,
    **sampling: Any,
) -> Gen:
    """Generate into variable `name`; keyword arguments are SamplingParams fields.

    Without a name (SGLang's form) the text is appended to the state but kept in no variable.
    Constrain the text with one of `regex`, `schema` (a pydantic model class: s[name] is then a
    validated instance; or a JSON-schema dict: a parsed dict), `choices` or an EBNF `grammar`.
    `next_turn_after_s`: the program's next request on this state comes about this long after
    this one finishes (a tool call, a user's reply); the engine keeps sooner returns cached.

    `tools` (Tools, functions or pydantic model classes): the model may call them (`tool_choice`
    "auto"), must ("required", or one tool's name or Tool: that one) or may not ("none");
    s[name] is then a list of `Call`s when it called, else its text. `reasoning=True` (or a
    format's name, "think" / "deepseek-r1") splits off a `<think>` block: s[name] is the
    answer after it, s.meta(name)["reasoning"] the reasoning, and a constraint applies to the
    answer only; `max_reasoning_tokens` closes the block at that length.

    >>> gen("answer", max_new_tokens=32, stop="\\n").params.max_new_tokens
    32
    """
    _check_name(name)
    if next_turn_after_s is not None and not next_turn_after_s >= 0:
        raise ProgramError(f"gen({name!r}): next_turn_after_s must be >= 0 seconds")
    thinking = thinking_args(name, reasoning, max_reasoning_tokens)
    params = sampling_params(name, sampling)
    given = given_constraint(name, regex=regex, schema=schema, choices=choices, grammar=grammar)
    if tools is not None:
        offered, choice = offered_tools(name, tools, tool_choice, given)
        return Gen(
            name,
            params,
            next_turn_after_s=next_turn_after_s,
            tools=offered,
            tool_choice=choice,
            parallel_tool_calls=bool(parallel_tool_calls),
            **thinking,
        )
    if tool_choice != "auto":
        raise ProgramError(f"gen({name!r}): tool_choice={tool_choice!r} needs tools=[...]")
    if not given:
        return Gen(name, params, next_turn_after_s=next_turn_after_s, **thinking)
    constraint, parse, label = constraint_of(name, *next(iter(given.items())))
    return Gen(name, params, constraint, parse, label, next_turn_after_s, **thinking)


def gen_int(name: str | None = None, **sampling: Any) -> Gen:
    """Generate an integer; s[name] is an int."""
    node = gen(name, regex=INT_REGEX, **sampling)
    return dataclasses.replace(node, parse=int, parse_label="int")


def gen_float(name: str | None = None, **sampling: Any) -> Gen:
    """Generate a decimal number; s[name] is a float."""
    node = gen(name, regex=FLOAT_REGEX, **sampling)
    return dataclasses.replace(node, parse=float, parse_label="float")


def select(
    name: str | None = None,
    choices: Sequence[str] = (),
    method: str | ChoicesMethod = "token_length_normalized",
) -> Select:
    """Pick one of `choices` by the model's likelihood; the pick goes into variable `name`.

    `method` is a name in flowlang.selection.METHODS or one of its objects.

    >>> select("ok", choices=[" yes", " no"], method="greedy").method
    'greedy'
    """
    _check_name(name)
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ProgramError(f"select({name!r}) needs a non-empty list of non-empty strings")
    known = method_name(method)
    if known is None:
        raise ProgramError(f"select({name!r}): unknown method {method!r}; use {list(METHODS)}")
    return Select(name, tuple(choices), known)


def system(*content: Any, tools: Sequence[Any] | None = None) -> list[Node]:
    """A system message; with `tools`, their definitions too (see `role`)."""
    return role("system", *content, tools=tools)


def user(*content: Any, tools: Sequence[Any] | None = None) -> list[Node]:
    """A user message."""
    return role("user", *content, tools=tools)


def assistant(*content: Any) -> list[Node]:
    """An assistant message."""
    return role("assistant", *content)


def role(name: str, *content: Any, tools: Sequence[Any] | None = None) -> list[Node]:
    """A chat message: the model's chat template decides the text around `content`.

    With `tools`, the message shows the model their definitions: as its chat template renders
    them when the template knows tools, else as a "# Tools" section after the content (the
    definitions and one call written in the model's tool format).

    >>> [type(n).__name__ for n in role("system", "Be brief.")]
    ['RoleBegin', 'Text', 'RoleEnd']
    """
    return [role_begin(name, tools), *to_nodes(list(content)), RoleEnd(name)]


def role_begin(name: str, tools: Sequence[Any] | None = None) -> RoleBegin:
    """The start of a `name` message (with the definitions of `tools`, if given)."""
    if tools is None:
        return RoleBegin(name)
    offered = as_tools(tools, f"{name} message")
    if not offered:
        raise ProgramError(f"a {name} message got tools=[]; leave tools= out")
    return RoleBegin(name, offered)


def tool_result(call: Call | ToolCall, value: Any) -> ToolResult:
    """The result of `call` as a tool message (text as is, anything else as JSON); add it after
    the assistant message that made the call.

    >>> from flowlang.tools import tool
    >>> call = tool(lambda x: x, name="echo").call({"x": 1}, "call_0")
    >>> tool_result(call, {"ok": True}).outputs[0].content
    '{"ok": true}'
    """
    if not isinstance(call, Call | ToolCall):
        raise ProgramError(
            f"tool_result() takes the Call it answers (from s[name] of a gen with tools), "
            f"got {type(call).__name__}"
        )
    return tool_results([(call, result_text(value))])


def tool_results(outputs: Sequence[tuple[Call | ToolCall, str]]) -> ToolResult:
    """Several calls' results (as text), in call order: the tool messages of one round."""
    items = tuple(ToolOutput(call.id, call.name, content) for call, content in outputs)
    return ToolResult("\n".join(o.content for o in items), items)


def fewshot(template: str, examples: Iterable[Mapping[str, Any]], **context: Any) -> Text:
    """Render a jinja2 few-shot template once over `examples` (as `examples` in the template).

    >>> fewshot("{% for e in examples %}Q: {{ e.q }} A: {{ e.a }}\\n{% endfor %}",
    ...         [{"q": "1+1", "a": "2"}]).text
    'Q: 1+1 A: 2\\n'
    """
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        return Text(env.from_string(template).render(examples=list(examples), **context))
    except jinja2.TemplateError as err:
        raise ProgramError(f"fewshot template: {err}") from err


def to_nodes(value: Any) -> list[Node]:
    """Anything a program may add to a state, as a flat list of IR nodes."""
    if isinstance(value, str):
        return [Text(value)] if value else []
    if isinstance(value, Text | RoleBegin | RoleEnd | Gen | Select):
        return [value]
    if isinstance(value, list | tuple):
        return [node for item in value for node in to_nodes(item)]
    raise ProgramError(
        f"cannot add a {type(value).__name__} to a program state; add str, gen(), select(), "
        f"or a role such as user(...)"
    )


def _check_name(name: str | None) -> None:
    # any non-empty string, as SGLang allows ("air port code"): names are only dict keys
    if name is not None and (not isinstance(name, str) or not name):
        raise ProgramError(f"a variable name must be a non-empty string, got {name!r}")
