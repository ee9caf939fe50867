"""How each model family writes tool calls: the text of a call, an xgrammar structural tag that
holds every call to its tool's JSON schema, and a parser that takes the calls out of an output,
whole or as it streams. Torch-free (flowlang imports it): the tags are plain JSON, compiled
elsewhere (runtime/constrain/probe.py).

Families, a module each behind base.ToolFormat: "hermes" (hermes.py), "llama3" (llama3.py)
and "mistral" (mistral.py). The tags are built in tags.py, composed with an answer format and
a reasoning block in composition.py; calls are read out of the JSON by calls.py and
partial_json.py, and streamed by stream.py; templates.py reads what a chat template shows.
Everything a caller needs is named here.
"""

from __future__ import annotations

from runtime.constrain.format_names import canonical_format_name
from runtime.constrain.tool_calls.base import ParsedCalls, ToolFormat
from runtime.constrain.tool_calls.composition import (
    answer_after_reasoning,
    answer_format,
    output_constraint,
)
from runtime.constrain.tool_calls.hermes import HERMES
from runtime.constrain.tool_calls.llama3 import LLAMA3
from runtime.constrain.tool_calls.mistral import MISTRAL
from runtime.constrain.tool_calls.stream import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    StreamEvent,
    ToolCallStream,
)
from runtime.constrain.tool_calls.tags import MAX_WHITESPACE_RUN, InvalidTools
from runtime.constrain.tool_calls.templates import detect_tool_format, template_supports_tools

__all__ = [
    "FORMAT_NAMES",
    "MAX_WHITESPACE_RUN",
    "ArgumentsDelta",
    "CallStart",
    "ContentDelta",
    "InvalidTools",
    "ParsedCalls",
    "StreamEvent",
    "ToolCallStream",
    "ToolFormat",
    "UnknownToolFormat",
    "answer_after_reasoning",
    "answer_format",
    "detect_tool_format",
    "output_constraint",
    "template_supports_tools",
    "tool_format",
]

_FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in (HERMES, LLAMA3, MISTRAL)}
FORMAT_NAMES = tuple(_FORMATS)
_ALIASES = {
    "qwen": "hermes",
    "qwen25": "hermes",
    "qwen3": "hermes",
    "llama": "llama3",
    "llama3_json": "llama3",
}


class UnknownToolFormat(ValueError):
    """A tool call parser name that is none of FORMAT_NAMES (or their aliases)."""


def tool_format(name: str) -> ToolFormat:
    """The tool call format called `name` (or one of its aliases)."""
    key = canonical_format_name(name, FORMAT_NAMES, _ALIASES, UnknownToolFormat, "tool call parser")
    return _FORMATS[key]
