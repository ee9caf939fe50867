"""The xgrammar structural tags that hold an output's calls to their tools' schemas (plain
JSON: compiled elsewhere, runtime/constrain/probe.py), and the reasoning block before them."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import regex

from runtime.constrain.check import MAX_NESTING_DEPTH, nests_deeper
from runtime.constrain.reasoning import ReasoningFormat
from runtime.protocol import TOOL_NAME_PATTERN, ToolSpec

if TYPE_CHECKING:  # the format module asks here for its tags: for the annotation only
    from runtime.constrain.tool_calls.base import ToolFormat

MAX_WHITESPACE_RUN = 1  # in a call's arguments: json.dumps writes single spaces
# "</think>\n\n" before a call or an answer that must come right after the reasoning
_AFTER_REASONING = {"type": "regex", "pattern": r"\n{0,2}"}
_TOOL_NAME = regex.compile(TOOL_NAME_PATTERN)


class InvalidTools(ValueError):
    """Tools or a tool choice that no grammar can be built for."""


def tools_tag(
    fmt: ToolFormat,
    tools: Sequence[ToolSpec],
    choice: str,
    parallel: bool,
    reasoning: ReasoningFormat | None,
    in_reasoning: bool,
    answer: dict | None,
    reasoning_budget: int | None,
) -> dict:
    """The tag of ToolFormat.structural_tag (its docstring says what the arguments are)."""
    tools = _checked(tools)
    markers = [] if reasoning is None else [reasoning.begin, reasoning.end]
    tags = [call_tag(fmt, tool) for tool in tools]

    def calls(at_least_one: bool) -> dict:
        # at_least_one: the first call comes first, free text may follow the calls
        return {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": tags,
            "at_least_one": at_least_one,
            "stop_after_first": not parallel,
            "excludes": markers,
        }

    if choice == "required" and not tools:
        raise InvalidTools("tool_choice 'required' needs at least one tool")
    if choice == "none" or (choice == "auto" and not tools):
        # tools shown but not to be called: the text may not start a call
        excludes = [*markers, fmt.trigger] if choice == "none" else markers
        body = {"type": "any_text", "excludes": excludes} if answer is None else answer
        forced = answer is not None
    elif choice == "auto":
        body, forced = _auto_body(answer, calls)
    elif choice == "required":
        body, forced = calls(True), True
    else:
        body, forced = _named_tag(tools, tags, choice), True
    return {
        "type": "structural_tag",
        "format": after_reasoning(body, reasoning, in_reasoning, forced, reasoning_budget),
    }


def call_tag(fmt: ToolFormat, tool: ToolSpec) -> dict:
    """The tag of one call to `tool`, its arguments held to the tool's schema."""
    begin = f'{fmt.begin}{json.dumps(tool.name)}, "{fmt.argument_key}": '
    schema = {
        "type": "json_schema",
        "json_schema": _object_schema(tool),
        # JSON's whitespace is free; a model (a random one surely) can fill max_tokens
        # with it inside a call that then never closes
        "max_whitespace_cnt": MAX_WHITESPACE_RUN,
    }
    return {"type": "tag", "begin": begin, "content": schema, "end": fmt.end}


def after_reasoning(
    body: dict,
    reasoning: ReasoningFormat | None,
    in_reasoning: bool,
    forced: bool,
    budget: int | None = None,
) -> dict:
    """`body` after a reasoning block: one that continues (the prompt opened it) or an
    optional one. `forced`: body must come right after the block (a newline or two aside)."""
    if reasoning is None:
        return body
    block: dict = {
        "type": "tag",
        "begin": "" if in_reasoning else reasoning.begin,
        "content": {"type": "any_text", "excludes": [reasoning.begin, reasoning.end]},
        "end": reasoning.end,
    }
    if budget is not None:  # xgrammar closes the block once it is this many tokens long
        block["content"]["max_tokens"] = budget
    if not in_reasoning:
        block = {"type": "optional", "content": block}
    elements = [block, _AFTER_REASONING, body] if forced else [block, body]
    return {"type": "sequence", "elements": elements}


def _auto_body(answer: dict | None, calls: Callable[[bool], dict]) -> tuple[dict, bool]:
    """Calls the model may make; with an answer format: that answer, or calls (and free text
    only after them). Whether the body is forced right after the reasoning, too."""
    if answer is None:
        return calls(False), False
    return {"type": "or", "elements": [answer, calls(True)]}, True


def _named_tag(tools: list[ToolSpec], tags: list[dict], choice: str) -> dict:
    """The tag of the one tool `choice` names."""
    named = [i for i, tool in enumerate(tools) if tool.name == choice]
    if not named:
        known = ", ".join(repr(tool.name) for tool in tools) or "none"
        raise InvalidTools(f"tool_choice {choice!r} names no given tool (tools: {known})")
    return tags[named[0]]


def _checked(tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    """`tools`, refused when a name is not a function name or is given twice."""
    tools, seen = list(tools), set()
    for tool in tools:
        if not isinstance(tool.name, str) or not _TOOL_NAME.match(tool.name):
            raise InvalidTools(
                f"tool name {tool.name!r} is not a function name ({TOOL_NAME_PATTERN})"
            )
        if tool.name in seen:
            raise InvalidTools(f"tool {tool.name!r} is given twice")
        seen.add(tool.name)
        _object_schema(tool)
    return tools


def _object_schema(tool: ToolSpec) -> dict:
    """The tool's parameters schema, held to a JSON object (arguments must be one)."""
    schema = tool.parameters
    if not isinstance(schema, dict):
        raise InvalidTools(f"the parameters of tool {tool.name!r} are not a JSON schema")
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidTools(
            f"the parameters of tool {tool.name!r} must be an object schema, not type {kind!r}"
        )
    if nests_deeper(schema):  # before anything recurses through it (as json_schema's check)
        raise InvalidTools(
            f"the parameters of tool {tool.name!r} nest deeper than {MAX_NESTING_DEPTH} levels "
            "of objects and lists"
        )
    return {"type": "object", **schema}
