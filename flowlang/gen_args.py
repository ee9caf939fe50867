"""gen()'s arguments checked, and its output constraint assembled, one concern per helper.

Every check raises a ProgramError naming the gen, at the call: a mistake in a program shows
where it was written, not when a worker thread later runs the node.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from flowlang.errors import ProgramError
from flowlang.ir import TOOL_CHOICES
from flowlang.tools import Tool, as_tools
from runtime.protocol import Constraint, SamplingParams


def thinking_args(name: str | None, reasoning: Any, max_reasoning_tokens: Any) -> dict[str, Any]:
    """gen's `reasoning` and `max_reasoning_tokens`, checked, as Gen's keyword arguments."""
    reasoning = check_reasoning(name, reasoning)
    if max_reasoning_tokens is not None:
        if not reasoning:
            raise ProgramError(f"gen({name!r}): max_reasoning_tokens needs reasoning=True")
        if not isinstance(max_reasoning_tokens, int) or max_reasoning_tokens < 1:
            raise ProgramError(f"gen({name!r}): max_reasoning_tokens must be a positive int")
    return {"reasoning": reasoning, "max_reasoning_tokens": max_reasoning_tokens}


def check_reasoning(name: str | None, reasoning: Any) -> bool | str:
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


def sampling_params(name: str | None, sampling: dict[str, Any]) -> SamplingParams:
    """gen's sampling keywords as SamplingParams (pydantic's complaint names the field)."""
    try:
        return SamplingParams(**sampling)
    except ValueError as err:
        raise ProgramError(f"gen({name!r}): {err}") from err


def given_constraint(name: str | None, **kinds: Any) -> dict[str, Any]:
    """The one constraint given (kind -> value; empty for none), in the order of `kinds`."""
    given = {kind: value for kind, value in kinds.items() if value is not None}
    if len(given) > 1:
        raise ProgramError(f"gen({name!r}) takes one constraint, got {sorted(given)}")
    return given


def offered_tools(
    name: str | None, tools: Sequence[Any], tool_choice: Any, given: dict[str, Any]
) -> tuple[tuple[Tool, ...], str]:
    """The tools a gen offers and its tool choice as a string, checked."""
    if given:
        raise ProgramError(
            f"gen({name!r}): tools= constrains the output to text or calls; it cannot be "
            f"combined with {next(iter(given))}= (give the answer's format as a tool, a "
            f"pydantic model class, instead)"
        )
    offered = as_tools(tools, f"gen({name!r})")
    if not offered:
        raise ProgramError(f"gen({name!r}): tools= is empty; leave it out for plain text")
    return offered, check_tool_choice(name, tool_choice, offered)


def check_tool_choice(name: str | None, choice: Any, tools: tuple[Tool, ...]) -> str:
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


def constraint_of(
    name: str | None, kind: str, value: Any
) -> tuple[Constraint, Callable[[str], Any] | None, str]:
    """The constraint of one kind (regex, schema, choices, grammar), with how the output is
    parsed and the parse's label (a schema's: its model class or JSON; else none)."""
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as err:
            raise ProgramError(f"gen({name!r}): invalid regex {value!r}: {err}") from err
        return Constraint(regex=value), None, ""
    if kind == "schema":
        return schema_constraint(name, value)
    if kind == "choices":
        if not value or any(not isinstance(c, str) or not c for c in value):
            raise ProgramError(f"gen({name!r}) choices must be non-empty strings")
        return Constraint(choices=list(value)), None, ""
    return Constraint(grammar=value), None, ""


def schema_constraint(name: str | None, schema: Any):
    """A pydantic model class (parsed into an instance) or a JSON-schema dict (into a dict)."""
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
