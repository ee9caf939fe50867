"""How reasoning models mark their thinking: a `<think>...</think>` block before the answer,
split off the output whole or while it streams. Torch-free (flowlang imports it).

Two formats, the same markers: "think" (Qwen3 and the like: the model opens the block itself)
and "deepseek-r1" (the prompt's generation prefix already opened it, so the output starts
inside the block). Which case a request is in is read off the template's generation prompt
(never off the messages, which a user writes): `in_reasoning`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import regex

from runtime.constrain.format_names import canonical_format_name

REASONING_NAMES = ("think", "deepseek-r1")
_ALIASES = {"qwen3": "think", "deepseek_r1": "deepseek-r1", "r1": "deepseek-r1"}

# a jinja string literal, to read what a template writes
_STRING_LITERAL = regex.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", regex.S)


class UnknownReasoningFormat(ValueError):
    """A reasoning parser name that is none of REASONING_NAMES (or their aliases)."""


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers around a model's reasoning, and how to take the reasoning out of its text."""

    name: str
    begin: str = "<think>"
    end: str = "</think>"

    def in_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt ends inside an open block (its last begin marker is not closed)."""
        opened = prompt_text.rfind(self.begin)
        return opened >= 0 and prompt_text.find(self.end, opened + len(self.begin)) < 0

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning None when it has no block.

        The first block counts: text before its begin marker is content (unless it is only
        whitespace), a block without its end marker (cut by max_tokens) is all reasoning, and
        the newlines just inside the markers and just after the end marker are dropped.
        """
        before = ""
        if not in_reasoning:
            opened = text.find(self.begin)
            if opened < 0:
                return None, text
            before = text[:opened] if text[:opened].strip() else ""
            text = text[opened + len(self.begin) :]
        closed = text.find(self.end)
        if closed < 0:
            return text.strip("\n"), before
        return text[:closed].strip("\n"), before + text[closed + len(self.end) :].lstrip("\n")

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        """A splitter for this format's output as it streams."""
        return ReasoningStream(self, in_reasoning)


def reasoning_format(name: str) -> ReasoningFormat:
    """The reasoning format called `name` (or one of its aliases)."""
    key = canonical_format_name(
        name, REASONING_NAMES, _ALIASES, UnknownReasoningFormat, "reasoning parser"
    )
    return ReasoningFormat(key)


def detect_reasoning_format(chat_template: str | None) -> str | None:
    """The reasoning format a chat template implies: "deepseek-r1" when its generation prompt
    opens a `<think>` block itself, "think" when it mentions `<think>` otherwise, else None."""
    if not chat_template or "<think>" not in chat_template:
        return None
    branch = chat_template.rfind("add_generation_prompt")  # the generation prompt's branch
    if branch >= 0:
        for literal in _STRING_LITERAL.finditer(chat_template, branch):
            opened = literal.group().rfind("<think>")
            # Qwen3 writes an empty, closed block there when thinking is off: that opens nothing
            if opened >= 0 and "</think>" not in literal.group()[opened:]:
                return "deepseek-r1"
    return "think"


@dataclass
class ReasoningStream:
    """Splits a streamed output into ("reasoning" | "content", text) pieces, holding back only
    what may still turn out to be (part of) a marker or a newline that `split` drops."""

    format: ReasoningFormat
    in_reasoning: bool
    _state: str = field(init=False)  # "before" the block, "inside" it, or "after" it
    _pending: str = field(init=False, default="")  # received, not yet given out
    _started: bool = field(init=False, default=False)  # this part gave out text already

    def __post_init__(self) -> None:
        self._state = "inside" if self.in_reasoning else "before"

    def feed(self, delta: str) -> list[tuple[str, str]]:
        """The pieces `delta` completes."""
        self._pending += delta
        return self._advance(final=False)

    def finish(self) -> list[tuple[str, str]]:
        """The pieces held back, at the end of the output."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> list[tuple[str, str]]:
        pieces: list[tuple[str, str]] = []
        if self._state == "before":
            self._before(pieces, final)
        if self._state == "inside":
            self._inside(pieces, final)
        if self._state == "after":
            self._after(pieces)
        return [(kind, text) for kind, text in pieces if text]

    def _before(self, pieces: list[tuple[str, str]], final: bool) -> None:
        text, begin = self._pending, self.format.begin
        opened = text.find(begin)
        if opened >= 0:
            if self._started or text[:opened].strip():  # whitespace alone before it is dropped
                pieces.append(("content", text[:opened]))
            self._enter("inside", text[opened + len(begin) :])
            return
        ready = len(text) if final else len(text) - _partial_marker(text, begin)
        if final or self._started or text[:ready].strip():
            pieces.append(("content", text[:ready]))
            self._started = True
            self._pending = text[ready:]

    def _inside(self, pieces: list[tuple[str, str]], final: bool) -> None:
        text, end = self._pending, self.format.end
        if not self._started:
            text = text.lstrip("\n")
        closed = text.find(end)
        if closed >= 0:
            pieces.append(("reasoning", text[:closed].rstrip("\n")))
            self._enter("after", text[closed + len(end) :])
            return
        ready = len(text) if final else len(text) - _partial_marker(text, end)
        given = text[:ready].rstrip("\n")  # newlines may be the ones before the end marker
        pieces.append(("reasoning", given))
        self._started = self._started or bool(given)
        self._pending = text[len(given) :]

    def _after(self, pieces: list[tuple[str, str]]) -> None:
        text = self._pending if self._started else self._pending.lstrip("\n")
        pieces.append(("content", text))
        self._started = self._started or bool(text)
        self._pending = ""

    def _enter(self, state: str, rest: str) -> None:
        self._state, self._pending, self._started = state, rest, False


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
