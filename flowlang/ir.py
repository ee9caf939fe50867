"""The request-graph IR: small frozen nodes with no execution logic.

A program's stream is a sequence of these. `flowlang.executor` runs them,
`flowlang.tracing` records them into a RequestGraph, `flowlang.graph` prints and measures them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.protocol import Constraint, SamplingParams

SELECT_METHODS = ("token_length_normalized", "greedy", "unconditional_likelihood_normalized")
JOIN_MODES = ("gather", "concat")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class RoleBegin:
    role: str  # "system" | "user" | "assistant" (any role the chat template knows)


@dataclass(frozen=True)
class RoleEnd:
    role: str


@dataclass(frozen=True)
class Gen:
    name: str
    params: SamplingParams = field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    parse: Callable[[str], Any] | None = None  # text -> the value s[name] holds (typed gens)
    parse_label: str = ""  # what `parse` produces, for error messages


@dataclass(frozen=True)
class Select:
    name: str
    choices: tuple[str, ...]
    method: str = "token_length_normalized"


@dataclass(frozen=True)
class Fork:
    fork_id: str
    num_branches: int


@dataclass(frozen=True)
class Join:
    fork_id: str
    mode: str  # one of JOIN_MODES


Node = Text | RoleBegin | RoleEnd | Gen | Select | Fork | Join
