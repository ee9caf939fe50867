"""The request-graph IR: small frozen nodes with no execution logic.

A program's stream is a sequence of these. `flowlang.executor` runs them,
`flowlang.tracing` records them into a RequestGraph, `flowlang.graph` prints and measures them.
`+` joins text and the nodes a program writes into a Seq (`"A:" + gen("x") + "\n"`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowlang.tools import Tool
from runtime.protocol import Constraint, SamplingParams

JOIN_MODES = ("gather", "concat")
TOOL_CHOICES = ("auto", "required", "none")  # or the name of one of the offered tools


class Seq(tuple):
    """Text and nodes joined with `+`; a program adds it like a list.

    >>> [type(n).__name__ for n in "A:" + Seq([Text(" B")]) + "\n"]
    ['Text', 'Text', 'Text']
    """

    def __add__(self, other: Any) -> Seq:
        items = _seq_items(other)
        return NotImplemented if items is None else Seq((*self, *items))

    def __radd__(self, other: Any) -> Seq:
        items = _seq_items(other)
        return NotImplemented if items is None else Seq((*items, *self))


class _Joinable:
    """A node `+` text or another node is a Seq (SGLang's string concatenation)."""

    def __add__(self, other: Any) -> Seq:
        return Seq((self,)) + other

    def __radd__(self, other: Any) -> Seq:
        return other + Seq((self,))


def _seq_items(value: Any) -> tuple | None:
    """What `value` adds to a Seq (None: `+` does not take it)."""
    if isinstance(value, str):
        return (Text(value),) if value else ()
    if isinstance(value, _Joinable):
        return (value,)
    if isinstance(value, list | tuple):
        items = [_seq_items(v) for v in value]
        return None if None in items else tuple(n for i in items for n in i)
    return None


@dataclass(frozen=True)
class Text(_Joinable):
    text: str


@dataclass(frozen=True)
class ToolOutput:
    call_id: str
    name: str
    content: str  # the result as the model reads it


@dataclass(frozen=True)
class ToolResult(Text):
    """The results of one round of tool calls, as the tool messages that follow the call.

    A Text (`text` holds the contents, for previews) so that everything that renders a
    stream's text, tracing included, renders it through the Renderer, which knows the kind.
    """

    outputs: tuple[ToolOutput, ...] = ()


@dataclass(frozen=True)
class RoleBegin(_Joinable):
    role: str  # "system" | "user" | "assistant" (any role the chat template knows)
    tools: tuple[Tool, ...] = ()  # tool definitions the message shows the model


@dataclass(frozen=True)
class RoleEnd(_Joinable):
    role: str


@dataclass(frozen=True)
class Gen(_Joinable):
    name: str | None  # None: anonymous, the text is appended but kept in no variable
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    parse: Callable[[str], Any] | None = None  # text -> the value s[name] holds (typed gens)
    parse_label: str = ""  # what `parse` produces, for error messages
    next_turn_after_s: float | None = None  # declared delay before this state's next request
    tools: tuple[Tool, ...] = ()  # the model may call these; the constraint is built at run time
    tool_choice: str = "auto"  # one of TOOL_CHOICES or an offered tool's name
    parallel_tool_calls: bool = True
    reasoning: bool | str = False  # True: the backend's reasoning format; a str: that format
    reasoning_var: str | None = None  # also define this variable as the reasoning (SGLang's)
    max_reasoning_tokens: int | None = None  # the reasoning block is closed at this length


@dataclass(frozen=True)
class Select(_Joinable):
    name: str | None
    choices: tuple[str, ...]
    method: str = "token_length_normalized"  # a name in flowlang.selection.METHODS


@dataclass(frozen=True)
class Fork:
    fork_id: str
    num_branches: int


@dataclass(frozen=True)
class Join:
    fork_id: str
    mode: str  # one of JOIN_MODES


Node = Text | RoleBegin | RoleEnd | Gen | Select | Fork | Join
