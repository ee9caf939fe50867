"""The mistral family: `[TOOL_CALLS] [...]`, a list of call objects, or the newer
`[TOOL_CALLS]NAME[ARGS]{...}`."""

from __future__ import annotations

from dataclasses import dataclass

import regex

from runtime.constrain.tool_calls.base import BLANK, Opening, ToolFormat, Verdict
from runtime.constrain.tool_calls.calls import calls_in, one_call
from runtime.protocol import ToolSpec

_OPEN = regex.compile(
    r"\[TOOL_CALLS\]" + BLANK + r"(?:\[|([A-Za-z0-9_.-]{1,64})"
    r"(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]" + BLANK + r"\{)"
)


@dataclass(frozen=True)
class Mistral(ToolFormat):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]NAME[ARGS]{...}`."""

    def opening(self, text: str, at: int) -> tuple[regex.Pattern, bool]:
        return _OPEN, False

    def calls_after(self, found: Opening, tools: dict[str, ToolSpec]) -> Verdict:
        name, value = found.match.group(1), found.value
        if name is None:  # [TOOL_CALLS] [...]
            calls = calls_in(value, tools, "id") if isinstance(value, list) else ()
        else:  # NAME[ARGS]{...}: the value is the arguments
            calls = one_call(name, value) if name in tools and value is not None else ()
        return Verdict(found.end, calls)


MISTRAL = Mistral(
    "mistral", "[TOOL_CALLS]", '[TOOL_CALLS] [{"name": ', "arguments", "}]",
    joiner="", separator="", triggers=("[TOOL_CALLS]",),
)  # fmt: skip
