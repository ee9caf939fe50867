"""What programs write: gen, select, roles, few-shot blocks. Each returns IR nodes; nothing runs."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2

from flowlang.errors import ProgramError
from flowlang.ir import (
    TOOL_CHOICES,
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
from runtime.protocol import Constraint, SamplingParams, ToolCall

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
    reasoning = _check_reasoning(name, reasoning)
    if max_reasoning_tokens is not None:
        if not reasoning:
            raise ProgramError(f"gen({name!r}): max_reasoning_tokens needs reasoning=True")
        if not isinstance(max_reasoning_tokens, int) or max_reasoning_tokens < 1:
            raise ProgramError(f"gen({name!r}): max_reasoning_tokens must be a positive int")
    thinking = {"reasoning": reasoning, "max_reasoning_tokens": max_reasoning_tokens}
    try:
        params = SamplingParams(**sampling)
    except ValueError as err:
        raise ProgramError(f"gen({name!r}): {err}") from err
    given = {
        k: v
        for k, v in (
            ("regex", regex),
            ("schema", schema),
            ("choices", choices),
            ("grammar", grammar),
        )
        if v is not None
    }
    if len(given) > 1:
        raise ProgramError(f"gen({name!r}) takes one constraint, got {sorted(given)}")
    if tools is not None:
        if given:
            raise ProgramError(
                f"gen({name!r}): tools= constrains the output to text or calls; it cannot be "
                f"combined with {next(iter(given))}= (give the answer's format as a tool, a "
                f"pydantic model class, instead)"
            )
        offered = as_tools(tools, f"gen({name!r})")
        if not offered:
            raise ProgramError(f"gen({name!r}): tools= is empty; leave it out for plain text")
        choice = _check_tool_choice(name, tool_choice, offered)
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
    kind, value = next(iter(given.items()))
    parse, label = None, ""
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as err:
            raise ProgramError(f"gen({name!r}): invalid regex {value!r}: {err}") from err
        constraint = Constraint(regex=value)
    elif kind == "schema":
        constraint, parse, label = _schema_constraint(name, value)
    elif kind == "choices":
        if not value or any(not isinstance(c, str) or not c for c in value):
            raise ProgramError(f"gen({name!r}) choices must be non-empty strings")
        constraint = Constraint(choices=list(value))
    else:
        constraint = Constraint(grammar=value)
    return Gen(name, params, constraint, parse, label, next_turn_after_s, **thinking)


def gen_int(name: str | None = None, **sampling: Any) -> Gen:
    """Generate an integer; s[name] is an int."""
    node = gen(name, regex=INT_REGEX, **sampling)
    return dataclasses.replace(node, parse=int, parse_label="int")


def gen_float(name: str | None = None, **sampling: Any) -> Gen:
    """Generate a decimal number; s[name] is a float."""
    node = gen(name, regex=FLOAT_REGEX, **sampling)
    return dataclasses.replace(node, parse=float, parse_label="float")


def _check_tool_choice(name: str | None, choice: Any, tools: tuple[Tool, ...]) -> str:
    """The tool choice as a string: one of TOOL_CHOICES or an offered tool's name."""
    if isinstance(choice, Tool):
        choice = choice.name
    names = [t.name for t in tools]
    if not isinstance(choice, str) or (choice not in TOOL_CHOICES and choice not in names):
        raise ProgramError(
            f"gen({name!r}): tool_choice must be one of {list(TOOL_CHOICES)} or an offered "
            f"tool's name {names}, got {choice!r}"
        )
    return choice


def _check_reasoning(name: str | None, reasoning: Any) -> bool | str:
    """`reasoning` checked: a bool, or a known reasoning format's name."""
    if isinstance(reasoning, bool):
        return reasoning
    if not isinstance(reasoning, str):
        raise ProgramError(
            f"gen({name!r}): reasoning must be True/False or a format's name, got {reasoning!r}"
        )
    from runtime.constrain.reasoning import UnknownReasoningFormat, reasoning_format

    try:
        return reasoning_format(reasoning).name
    except UnknownReasoningFormat as err:
        raise ProgramError(f"gen({name!r}): {err}") from err


def _schema_constraint(name: str, schema: Any):
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return (
            Constraint(json_schema=schema.model_json_schema()),
            schema.model_validate_json,
            schema.__name__,
        )
    if isinstance(schema, dict):
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as err:
            raise ProgramError(f"gen({name!r}): the JSON schema is not JSON: {err}") from err
        return Constraint(json_schema=schema), json.loads, "JSON"
    raise ProgramError(
        f"gen({name!r}): schema must be a pydantic model class or a JSON-schema "
        f"dict, got {type(schema).__name__}"
    )


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
