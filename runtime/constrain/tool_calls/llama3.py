"""The llama3 family: a bare JSON call object, arguments under "parameters"."""

from __future__ import annotations

from dataclasses import dataclass

import regex

from runtime.constrain.tool_calls.base import BLANK, Opening, ToolFormat, Verdict
from runtime.constrain.tool_calls.calls import calls_in
from runtime.protocol import ToolSpec

_TAG = regex.compile(r"<\|python_tag\|>" + BLANK + r"[{\[]")
_OPENINGS = {  # by the trigger's first character
    "<": _TAG,
    "{": regex.compile(r"\{" + BLANK + r'"name"' + BLANK + ":"),
    "[": regex.compile(r"\[" + BLANK + r"\{" + BLANK + r'"name"' + BLANK + ":"),
}


@dataclass(frozen=True)
class Llama3(ToolFormat):
    """A bare {"name": ..., "parameters": {...}} (or a list of them), after an optional
    `<|python_tag|>`; calls separated by ";" or newlines."""

    def opening(self, text: str, at: int) -> tuple[regex.Pattern, bool]:
        pattern = _OPENINGS[text[at]]
        return pattern, pattern is not _TAG  # a bare object starts where its opening does

    def calls_after(self, found: Opening, tools: dict[str, ToolSpec]) -> Verdict:
        return Verdict(found.end, calls_in(found.value, tools))


LLAMA3 = Llama3(
    "llama3", '{"name": ', '{"name": ', "parameters", "}",
    joiner="; ", separator=";", triggers=("{", "[", "<|python_tag|>"),
)  # fmt: skip
