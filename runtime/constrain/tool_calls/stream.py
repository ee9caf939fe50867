"""Calls taken out of an output as it streams: the events a stream gives, and the rule that
joins the text between calls into the content (the whole-text parse follows it too)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.constrain.tool_calls.calls import by_name, call_id
from runtime.constrain.tool_calls.partial_json import JsonReader
from runtime.protocol import ToolSpec

if TYPE_CHECKING:  # the format module builds streams: imported here for the annotation only
    from runtime.constrain.tool_calls.base import ToolFormat


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Text of the content (the output without its calls)."""

    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call begins: its index in the output, its id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """Text of call `index`'s arguments (a JSON object, in pieces)."""

    index: int
    text: str


StreamEvent = ContentDelta | CallStart | ArgumentsDelta


class ToolCallStream:
    """Takes the calls out of an output as it streams. Holds back only text that may still
    start a call (or whitespace the content drops around one); gives a call (CallStart, then
    its arguments) once it is complete. The pieces add up to what `parse` gives."""

    def __init__(self, tool_format: ToolFormat, tools: Sequence[ToolSpec]) -> None:
        self.format = tool_format
        self.tools = by_name(tools)
        self._buffer = ""  # text not yet taken apart
        self._offset = 0  # where the buffer starts in the output
        self._memo: dict = {}  # JSON read so far, by position in the output (JsonReader's)
        self._memo_kept = 0  # entries after the last filtering
        self._content = ContentJoiner(tool_format.separator)
        self._num_calls = 0
        self._finished = False

    def feed(self, delta: str) -> list[StreamEvent]:
        """The events `delta` completes."""
        return self._take(delta, final=False)

    def finish(self) -> list[StreamEvent]:
        """The events held back, at the end of the output (an unfinished call is text)."""
        events = self._take("", final=True)
        tail = self._content.finish()
        return events + [ContentDelta(tail)] if tail else events

    def _take(self, delta: str, final: bool) -> list[StreamEvent]:
        if self._finished:
            raise ValueError("this tool call stream has finished")
        self._finished = final
        self._buffer += delta
        reader = JsonReader(self._buffer, self._offset, self._memo)
        segments, done = self.format.scan(self._buffer, self.tools, final, reader)
        self._buffer = self._buffer[done:]
        self._offset += done
        if len(self._memo) > 2 * self._memo_kept + 64:  # amortized: linear over the stream
            self._memo = {at: json for at, json in self._memo.items() if at >= self._offset}
            self._memo_kept = len(self._memo)
        events: list[StreamEvent] = []
        for segment in segments:
            if isinstance(segment, str):
                text = self._content.add(segment)
                events += [ContentDelta(text)] if text else []
                continue
            self._content.call()
            for name, arguments in segment:
                index, self._num_calls = self._num_calls, self._num_calls + 1
                events += [CallStart(index, call_id(), name), ArgumentsDelta(index, arguments)]
        return events


class ContentJoiner:
    """Joins the text between calls into the content (the rule `ToolFormat.parse` states), a
    piece at a time: whatever the pieces, the result is the same."""

    def __init__(self, separator: str) -> None:
        self.separator = separator
        self.held = ""  # this stretch of text (since the last call), not yet given out
        self.after_call = False  # this stretch follows a call
        self.started = False  # this stretch gave out text
        self.any = False  # some content was given out
        self.gap = ""  # the whitespace after the last text given out, before the calls since

    def add(self, text: str) -> str:
        """What of the content `text` completes."""
        held, glue = self.held + text, ""
        if self.after_call and not self.started:
            body = held.lstrip()
            if self.separator.startswith(body.rstrip()):
                self.held = held  # blank so far, or the separator: dropped if a call follows
                return ""
            if self.any:
                glue = self.gap or held[: len(held) - len(body)]
            held = body
        kept = held.rstrip()  # whitespace at the end is dropped if a call follows
        self.held = held[len(kept) :]
        if kept:
            self.started = self.any = True
        return glue + kept

    def call(self) -> None:
        """A call came: what was held back is dropped."""
        if self.started:
            self.gap = self.held
        self.held, self.after_call, self.started = "", True, False

    def finish(self) -> str:
        """The end of the output: what was held back is content."""
        held, self.held = self.held, ""
        if not self.after_call or self.started:
            return held
        body = held.lstrip()
        if not body:
            return ""
        return (self.gap or held[: len(held) - len(body)]) + body if self.any else body
