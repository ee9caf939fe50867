"""A call as the parsers give it: a family's JSON call object read into (name, arguments as
JSON text), held to the tools given; and the ids calls are given."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence

from runtime.protocol import ToolSpec

ARGUMENT_KEYS = ("arguments", "parameters")  # either is taken, whatever the family writes
Call = tuple[str, str]  # (name, arguments as JSON text)


def by_name(tools: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    return {tool.name: tool for tool in tools}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def one_call(name: str, arguments: dict) -> tuple[Call, ...]:
    """One call, arguments written as ToolCall.arguments has them; none if they cannot be
    (a lone surrogate, from a JSON escape, is no text a client can receive)."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return ()
    return ((name, text),)


def call_of(value: object, tools: dict[str, ToolSpec], *extra_keys: str) -> Call | None:
    """(name, arguments) of a call object {"name": ..., "arguments": {...}}, or None."""
    if not isinstance(value, dict) or value.keys() - {"name", *ARGUMENT_KEYS, *extra_keys}:
        return None
    arguments = [value[key] for key in ARGUMENT_KEYS if key in value]
    name = value.get("name")
    if len(arguments) != 1 or not isinstance(arguments[0], dict):
        return None
    if not isinstance(name, str) or name not in tools:  # a list or an object is no name
        return None
    call = one_call(name, arguments[0])
    return call[0] if call else None


def calls_in(value: object, tools: dict[str, ToolSpec], *extra_keys: str) -> tuple[Call, ...]:
    """The calls a call object or a list of them is; none unless every one is a call."""
    found = value if isinstance(value, list) else [value]
    calls = [call_of(item, tools, *extra_keys) for item in found]
    return () if None in calls or not calls else tuple(calls)
