"""Tools a program's model may call: `Tool` (a Python function, or a pydantic model class, with
its arguments' JSON schema) and `Call` (one call the model made, its arguments validated).

The schema comes from the signature through pydantic: type hints, defaults and
`Annotated[..., Field(description=...)]`; the description is the docstring's first paragraph.
Calls are decoded under a structural tag that admits only real tools with schema-valid
arguments, so a `Call` that fails validation means the output was cut or not constrained.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import pydantic
from pydantic import BaseModel

from flowlang.errors import InvalidOutputError, ProgramError
from flowlang.telemetry import tool_span
from runtime.protocol import TOOL_NAME_PATTERN, ToolCall, ToolSpec
from runtime.telemetry import tracer

MAX_TOOL_THREADS = 16  # calls of one round run at once, up to this many


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with its arguments' JSON schema and expected latency.

    >>> def clock(timezone: str = "UTC") -> str:
    ...     '''The current time in `timezone`.'''
    ...     return "12:00"
    >>> t = tool(clock, latency_s=0.05)
    >>> t.name, t.description, t.parameters["properties"]["timezone"]["default"]
    ('clock', 'The current time in `timezone`.', 'UTC')
    """

    name: str
    description: str
    parameters: dict  # the arguments' JSON schema (an object)
    fn: Callable[..., Any]  # the function; for a model tool, the model class
    arguments_model: type[BaseModel] = field(repr=False, compare=False)  # validates arguments
    latency_s: float | None = None  # how long a call is expected to take (a scheduling hint)
    is_model: bool = False  # a pydantic model class: a call's value is an instance of it

    def __hash__(self) -> int:  # the schema is a dict: hash what identifies the tool
        return hash((self.name, self.fn))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function itself (a decorated function stays callable)."""
        return self.fn(*args, **kwargs)

    @property
    def spec(self) -> ToolSpec:
        """The tool as the engine's protocol describes it."""
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)

    def call(self, arguments: dict | str, call_id: str = "call_0") -> Call:
        """A validated call of this tool (`arguments` as a dict or a JSON text)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as err:
                raise InvalidOutputError(
                    f"tool {self.name!r}: the arguments are not JSON: {err}; raw: {arguments!r}"
                ) from err
        if not isinstance(arguments, dict):
            raise InvalidOutputError(
                f"tool {self.name!r}: the arguments must be a JSON object, got {arguments!r}"
            )
        try:
            validated = self.arguments_model.model_validate(arguments)
        except pydantic.ValidationError as err:
            raise InvalidOutputError(
                f"tool {self.name!r}: invalid arguments {arguments!r}: "
                f"{str(err).splitlines()[0]} ({err.error_count()} errors)"
            ) from err
        if self.is_model:
            value: Any = validated
        else:  # the function's keyword arguments, converted by pydantic (aliases undone)
            value = {
                info.alias or key: getattr(validated, key)
                for key, info in type(validated).model_fields.items()
            }
        return Call(call_id, self.name, dict(arguments), self, value)


@dataclass(frozen=True)
class Call:
    """One call the model made: `arguments` (the decoded JSON) validated against the tool.

    `value` is what validation made of them: the model instance for a pydantic-model tool,
    the keyword arguments (a dict) for a function. `run()` calls the function.
    """

    id: str
    name: str
    arguments: dict
    tool: Tool = field(repr=False, compare=False)
    value: Any = field(repr=False, compare=False)

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def run(self) -> Any:
        """Run the tool on the validated arguments; its result (a model tool: the instance)."""
        if self.tool.is_model:
            return self.value
        return self.tool.fn(**self.value)

    @property
    def tool_call(self) -> ToolCall:
        """The call as the engine's protocol (and OpenAI's API) writes it."""
        return ToolCall(
            id=self.id, name=self.name, arguments=json.dumps(self.arguments, ensure_ascii=False)
        )


@dataclass(frozen=True)
class ToolRun:
    """What running one call gave: its result, or the exception it raised."""

    call: Call
    value: Any = None
    error: BaseException | None = None

    @property
    def text(self) -> str:
        """The result as the model reads it (an error as `{"error": "..."}`)."""
        if self.error is not None:
            return json.dumps({"error": f"{type(self.error).__name__}: {self.error}"})
        return result_text(self.value)


def tool(
    fn: Callable[..., Any] | type[BaseModel] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    latency_s: float | None = None,
) -> Any:
    """Make a Tool of a function or pydantic model class; use as `@tool` or `@tool(...)`.

    >>> @tool(latency_s=0.5)
    ... def search(query: str, top_k: int = 2) -> list[str]:
    ...     '''Search the documents.'''
    ...     return []
    >>> search.latency_s, search.spec.parameters["required"]
    (0.5, ['query'])
    """
    if fn is None:
        return lambda f: tool(f, name=name, description=description, latency_s=latency_s)
    if latency_s is not None and not latency_s >= 0:
        raise ProgramError(f"tool latency_s must be >= 0 seconds, got {latency_s!r}")
    if isinstance(fn, Tool):
        changes = {"name": name, "description": description, "latency_s": latency_s}
        made = replace(fn, **{k: v for k, v in changes.items() if v is not None})
    elif isinstance(fn, type) and issubclass(fn, BaseModel):
        made = _from_model(fn, name, description, latency_s)
    elif callable(fn):
        made = _from_function(fn, name, description, latency_s)
    else:
        raise ProgramError(
            f"a tool is a function, a pydantic model class or a Tool, got {type(fn).__name__}"
        )
    if not re.match(TOOL_NAME_PATTERN, made.name):
        raise ProgramError(
            f"tool name {made.name!r} must be 1-64 letters, digits, '_' or '-'; "
            f"pass name=... to tool()"
        )
    return made


def as_tool(value: Any) -> Tool:
    """`value` as a Tool: a Tool, a function or a pydantic model class."""
    return value if isinstance(value, Tool) else tool(value)


def as_tools(values: Sequence[Any], where: str) -> tuple[Tool, ...]:
    """Several tools, with distinct names (`where` names the caller for errors)."""
    if isinstance(values, str | Tool) or not isinstance(values, Sequence):
        raise ProgramError(f"{where}: tools= takes a list of tools, got {type(values).__name__}")
    tools = tuple(as_tool(v) for v in values)
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ProgramError(f"{where}: two tools are named {twice}; give one a name=...")
    return tools


def calls_from(wire_calls: Sequence[ToolCall], tools: Sequence[Tool]) -> list[Call]:
    """The typed calls of the engine's parsed `wire_calls` (InvalidOutputError if one names no
    offered tool or its arguments do not validate)."""
    by_name = {t.name: t for t in tools}
    calls = []
    for wire in wire_calls:
        if wire.name not in by_name:
            raise InvalidOutputError(
                f"the model called {wire.name!r}, which is not one of the tools {list(by_name)}"
            )
        calls.append(by_name[wire.name].call(wire.arguments, wire.id))
    return calls


def run_calls(calls: Sequence[Call]) -> list[ToolRun]:
    """Run `calls` at once on a thread pool (the calls of one round are independent); the
    outcomes in call order, a raised exception kept as the outcome's error."""

    parent = tracer().current_context()  # the pool's threads do not inherit it

    def run(call: Call) -> ToolRun:
        with tool_span(call.tool.name, call.id, parent) as span:
            try:
                return ToolRun(call, call.run())
            except Exception as err:  # noqa: BLE001 - the model reads the error, the program goes on
                span.record_error(err)
                return ToolRun(call, error=err)

    if len(calls) <= 1:
        return [run(c) for c in calls]
    with ThreadPoolExecutor(min(len(calls), MAX_TOOL_THREADS), "flowlang-tool") as pool:
        return list(pool.map(run, calls))


def result_text(value: Any) -> str:
    """A tool's result as the model reads it: text as is, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, ensure_ascii=False, default=str)


def first_paragraph(doc: str | None) -> str:
    """A docstring's first paragraph on one line."""
    if not doc:
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(paragraph.split())


# ---------------------------------------------------------------------- building tools


def _from_function(
    fn: Callable[..., Any], name: str | None, description: str | None, latency_s: float | None
) -> Tool:
    name = name or getattr(fn, "__name__", "")
    try:
        signature = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)
    except (TypeError, ValueError, NameError) as err:
        raise ProgramError(f"tool {name!r}: cannot read its signature: {err}") from err
    fields: dict[str, Any] = {}
    for index, param in enumerate(signature.parameters.values()):
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ProgramError(
                f"tool {name!r}: parameter {param.name!r} is {param.kind.description}; a tool "
                f"is called with named arguments only"
            )
        default = ... if param.default is param.empty else param.default
        # internal field names, the real ones as aliases: a parameter may be called `json`
        # or `schema`, which a pydantic model would refuse as field names
        fields[f"p{index}"] = (
            hints.get(param.name, Any),
            pydantic.Field(default, alias=param.name),
        )
    try:
        model = pydantic.create_model(
            f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        parameters = _clean_schema(model.model_json_schema())
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as err:
        raise ProgramError(f"tool {name!r}: its arguments have no JSON schema: {err}") from err
    parameters.pop("description", None)
    if description is None:
        description = first_paragraph(getattr(fn, "__doc__", None))
    return Tool(name, description, parameters, fn, model, latency_s)


def _from_model(
    model: type[BaseModel], name: str | None, description: str | None, latency_s: float | None
) -> Tool:
    name = name or model.model_config.get("title") or model.__name__
    try:
        parameters = _clean_schema(model.model_json_schema())
    except pydantic.PydanticUserError as err:
        raise ProgramError(f"tool {name!r}: the model has no JSON schema: {err}") from err
    parameters.pop("description", None)
    if description is None:  # its own docstring, not BaseModel's
        description = first_paragraph(model.__dict__.get("__doc__"))
    return Tool(name, description, parameters, model, model, latency_s, is_model=True)


_DATA_KEYS = ("default", "enum", "const", "examples")  # values there are data, not schemas
_NAMED_SCHEMAS = ("properties", "$defs", "definitions", "patternProperties")


def _clean_schema(schema: Any) -> Any:
    """Pydantic's schema without its generated titles (noise in a prompt)."""
    if isinstance(schema, list):
        return [_clean_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {n: _clean_schema(s) for n, s in value.items()}
        elif key in _DATA_KEYS:
            out[key] = value
        else:
            out[key] = _clean_schema(value)
    return out
