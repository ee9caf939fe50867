"""What every tool-call family shares: how a call is written, the structural tag, and the scan
that finds calls in an output (whole or streamed); a family says only what a call looks like
where one of its triggers stands (hermes.py, llama3.py, mistral.py)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import regex

from runtime.constrain.reasoning import ReasoningFormat
from runtime.constrain.tool_calls.calls import Call, by_name, call_id
from runtime.constrain.tool_calls.partial_json import JsonReader
from runtime.constrain.tool_calls.stream import ContentJoiner, ToolCallStream
from runtime.constrain.tool_calls.tags import tools_tag
from runtime.protocol import ToolCall, ToolSpec

BLANK = "[ \t\r\n]*"  # JSON's whitespace, in the families' opening patterns
Segment = str | tuple[Call, ...]  # a run of text, or a group of calls


@dataclass(frozen=True)
class ParsedCalls:
    """An output split into its content (the text without the calls) and the calls."""

    content: str
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the text at a trigger is: calls (ending at `end`), text (scanning goes on at
    `end`), or not known until more text comes."""

    end: int = 0
    calls: tuple[Call, ...] = ()
    more: bool = False


UNDECIDED = Verdict(more=True)


@dataclass(frozen=True, slots=True)
class Opening:
    """A family's opening at a trigger, and the JSON value after it, read whole."""

    match: regex.Match
    value: object  # None when it is no JSON Python takes
    end: int  # where the value ends in `text`
    text: str
    final: bool  # no more text comes


@dataclass(frozen=True)
class ToolFormat(ABC):
    """How one model family writes a call: `begin` "NAME", "ARGUMENT_KEY": ARGUMENTS `end`."""

    name: str
    trigger: str  # what starts a call inside free text (the grammar's trigger)
    begin: str
    argument_key: str
    end: str
    joiner: str  # between the calls of calls_text
    separator: str  # text between two calls that belongs to neither (dropped from the content)
    triggers: tuple[str, ...]  # what the parser looks at: the trigger and the variants it takes

    def call_text(self, name: str, arguments: dict) -> str:
        """How this family writes one call."""
        return (
            f"{self.begin}{json.dumps(name, ensure_ascii=False)}, "
            f'"{self.argument_key}": {json.dumps(arguments, ensure_ascii=False)}{self.end}'
        )

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        """How this family writes several calls, one after another."""
        return self.joiner.join(self.call_text(name, arguments) for name, arguments in calls)

    def structural_tag(
        self,
        tools: Sequence[ToolSpec],
        choice: str = "auto",
        parallel: bool = True,
        reasoning: ReasoningFormat | None = None,
        in_reasoning: bool = False,
        answer: dict | None = None,
        reasoning_budget: int | None = None,
    ) -> dict:
        """An xgrammar structural tag for an output that may (auto), must (required, or a
        tool's name: that one, once) or may not (none) call `tools`, every call held to its
        tool's parameters schema; after a reasoning block when `reasoning` is given.

        `answer` (an xgrammar format, such as {"type": "json_schema", ...}) is what the model
        writes instead of free text: with no tools (or choice none) the whole answer, with
        tools under auto the alternative to calling them. `reasoning_budget`: the most tokens
        the reasoning block may take before it is closed.
        """
        return tools_tag(
            self, tools, choice, parallel, reasoning, in_reasoning, answer, reasoning_budget
        )

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedCalls:
        """The calls to `tools` in a whole output, and the text around them.

        A call counts only when its JSON is complete, names one of `tools` and has an object
        for arguments; anything else stays in the content as it was. The content drops each
        call with the whitespace around it; text left on both sides is joined by the
        whitespace that stood before the call (or after it, when none stood before).
        """
        segments, _ = self.scan(text, by_name(tools), True, JsonReader(text, 0, {}))
        content, calls = ContentJoiner(self.separator), []
        pieces = []
        for segment in segments:
            if isinstance(segment, str):
                pieces.append(content.add(segment))
            else:
                calls += [ToolCall(id=call_id(), name=n, arguments=a) for n, a in segment]
                content.call()
        pieces.append(content.finish())
        return ParsedCalls("".join(pieces), calls)

    def stream(self, tools: Sequence[ToolSpec]) -> ToolCallStream:
        """A parser for this family's output as it streams."""
        return ToolCallStream(self, tools)

    def scan(
        self, text: str, tools: dict[str, ToolSpec], final: bool, reader: JsonReader
    ) -> tuple[list[Segment], int]:
        """Text runs and call groups of `text`, up to where they are known (all of it when
        `final`). `reader` reads the JSON of `text` (keeping what it read, for a stream)."""
        if not tools:
            return [text], len(text)
        segments: list[Segment] = []
        done = scan = 0
        while (hit := self._trigger_pattern.search(text, scan)) is not None:
            at = hit.start()
            verdict = self.match(text, at, final, reader, tools)
            if verdict.more:
                if not final:
                    _add_text(segments, text[done:at])
                    return segments, at
                verdict = Verdict(len(text))  # cut short: it was text
            if verdict.calls:
                _add_text(segments, text[done:at])
                segments.append(verdict.calls)
                done = verdict.end
            scan = verdict.end
        ready = len(text) if final else len(text) - self._partial_trigger(text, scan)
        _add_text(segments, text[done:ready])
        return segments, ready

    def match(
        self, text: str, at: int, final: bool, reader: JsonReader, tools: dict[str, ToolSpec]
    ) -> Verdict:
        """What the text at `at` (where a trigger stands) is; `final`: no more text comes.
        Undecided while the family's opening or the JSON value after it is unfinished."""
        pattern, at_opening = self.opening(text, at)
        opening = pattern.match(text, at, partial=not final)
        if opening is None:
            return Verdict(at + 1)
        if opening.partial:
            return UNDECIDED
        start = at if at_opening else opening.end() - 1
        end = reader.json_end(start)
        if end is None:
            return Verdict(at + 1)
        if end < 0:
            return UNDECIDED
        return self.calls_after(Opening(opening, reader.value(start, end), end, text, final), tools)

    @abstractmethod
    def opening(self, text: str, at: int) -> tuple[regex.Pattern, bool]:
        """The pattern of this family's opening at `at`, and whether its JSON value starts
        where the opening does (else at the opening's last character)."""

    @abstractmethod
    def calls_after(self, found: Opening, tools: dict[str, ToolSpec]) -> Verdict:
        """What an opening and the JSON value after it make: calls, or text."""

    @cached_property
    def _trigger_pattern(self) -> regex.Pattern:
        # cached_property writes the instance's __dict__ itself: a frozen dataclass allows it
        return regex.compile("|".join(regex.escape(t) for t in self.triggers))

    def _partial_trigger(self, text: str, scan: int) -> int:
        """The length of the longest end of text[scan:] that is a proper start of a trigger."""
        longest = min(len(text) - scan, max(len(t) for t in self.triggers) - 1)
        for size in range(longest, 0, -1):
            tail = text[len(text) - size :]
            if any(len(t) > size and t.startswith(tail) for t in self.triggers):
                return size
        return 0


def _add_text(segments: list[Segment], text: str) -> None:
    if text:
        segments.append(text)
