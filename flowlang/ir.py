"""The request-graph IR: small frozen nodes with no execution logic.

A program's stream is a sequence of these. `flowlang.executor` runs them,
`flowlang.tracing` records them into a RequestGraph, `flowlang.graph` prints and measures them.
`+` joins text and the nodes a program writes into a Seq (`"A:" + gen("x") + "\n"`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.protocol import Constraint, SamplingParams

JOIN_MODES = ("gather", "concat")


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
class RoleBegin(_Joinable):
    role: str  # "system" | "user" | "assistant" (any role the chat template knows)


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
