"""The hermes family (Qwen2.5, Qwen3, Hermes): `<tool_call>` JSON `</tool_call>`; also what a
template that knows no tools is taught."""

from __future__ import annotations

from dataclasses import dataclass

import regex

from runtime.constrain.tool_calls.base import BLANK, UNDECIDED, Opening, ToolFormat, Verdict
from runtime.constrain.tool_calls.calls import call_of
from runtime.protocol import ToolSpec

_OPEN = regex.compile(r"<tool_call>" + BLANK + r"\{")
_CLOSE = regex.compile(BLANK + r"</tool_call>")


@dataclass(frozen=True)
class Hermes(ToolFormat):
    """`<tool_call>` {"name": ..., "arguments": {...}} `</tool_call>`; the closing tag may be
    missing at the very end of the output (models often stop there)."""

    def opening(self, text: str, at: int) -> tuple[regex.Pattern, bool]:
        return _OPEN, False

    def calls_after(self, found: Opening, tools: dict[str, ToolSpec]) -> Verdict:
        call = call_of(found.value, tools)
        if call is None:
            return Verdict(found.end)
        closing = _CLOSE.match(found.text, found.end, partial=True)
        if closing is None:
            return Verdict(found.end)
        if not closing.partial:
            return Verdict(closing.end(), (call,))
        return Verdict(len(found.text), (call,)) if found.final else UNDECIDED


HERMES = Hermes(
    "hermes", "<tool_call>", '<tool_call>\n{"name": ', "arguments", "}\n</tool_call>",
    joiner="\n", separator="", triggers=("<tool_call>",),
)  # fmt: skip
