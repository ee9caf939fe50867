"""How each model family writes tool calls: the text of a call, an xgrammar structural tag that
holds every call to its tool's JSON schema, and a parser that takes the calls out of an output,
whole or as it streams. Torch-free (flowlang imports it): the tags are plain JSON, compiled
elsewhere (runtime/constrain/probe.py).

Families: "hermes" (Qwen2.5, Qwen3, Hermes: `<tool_call>` JSON `</tool_call>`; also what a
template that knows no tools is taught), "llama3" (a bare JSON object, arguments under
"parameters") and "mistral" (`[TOOL_CALLS] [...]`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import regex

from runtime.constrain.check import MAX_NESTING_DEPTH, nests_deeper
from runtime.constrain.reasoning import ReasoningFormat
from runtime.protocol import TOOL_NAME_PATTERN, Constraint, ToolCall, ToolSpec

FORMAT_NAMES = ("hermes", "llama3", "mistral")
_ALIASES = {
    "qwen": "hermes",
    "qwen25": "hermes",
    "qwen3": "hermes",
    "llama": "llama3",
    "llama3_json": "llama3",
}
_ARGUMENT_KEYS = ("arguments", "parameters")  # either is taken, whatever the family writes
_BLANK = "[ \t\r\n]*"  # JSON's whitespace
MAX_WHITESPACE_RUN = 1  # in a call's arguments: json.dumps writes single spaces
# "</think>\n\n" before a call or an answer that must come right after the reasoning
_AFTER_REASONING = {"type": "regex", "pattern": r"\n{0,2}"}


class UnknownToolFormat(ValueError):
    """A tool call parser name that is none of FORMAT_NAMES (or their aliases)."""


class InvalidTools(ValueError):
    """Tools or a tool choice that no grammar can be built for."""


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


@dataclass(frozen=True)
class ParsedCalls:
    """An output split into its content (the text without the calls) and the calls."""

    content: str
    calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class _Verdict:
    """What the text at a trigger is: calls (ending at `end`), text (scanning goes on at
    `end`), or not known until more text comes."""

    end: int = 0
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments as JSON text)
    more: bool = False


_UNDECIDED = _Verdict(more=True)


@dataclass(frozen=True)
class ToolFormat:
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
        tools = _checked(tools)
        markers = [] if reasoning is None else [reasoning.begin, reasoning.end]
        tags = [self._tag(tool) for tool in tools]

        def calls(at_least_one: bool) -> dict:
            # at_least_one: the first call comes first, free text may follow the calls
            return {
                "type": "triggered_tags",
                "triggers": [self.trigger],
                "tags": tags,
                "at_least_one": at_least_one,
                "stop_after_first": not parallel,
                "excludes": markers,
            }

        if choice == "required" and not tools:
            raise InvalidTools("tool_choice 'required' needs at least one tool")
        if choice == "none" or (choice == "auto" and not tools):
            # tools shown but not to be called: the text may not start a call
            excludes = [*markers, self.trigger] if choice == "none" else markers
            body = {"type": "any_text", "excludes": excludes} if answer is None else answer
            forced = answer is not None
        elif choice == "auto":
            # with an answer format: that answer, or calls (and free text only after them)
            body = (
                calls(False)
                if answer is None
                else {"type": "or", "elements": [answer, calls(True)]}
            )
            forced = answer is not None
        elif choice == "required":
            body, forced = calls(True), True
        else:
            named = [i for i, tool in enumerate(tools) if tool.name == choice]
            if not named:
                known = ", ".join(repr(tool.name) for tool in tools) or "none"
                raise InvalidTools(f"tool_choice {choice!r} names no given tool (tools: {known})")
            body, forced = tags[named[0]], True
        return {
            "type": "structural_tag",
            "format": _after_reasoning(body, reasoning, in_reasoning, forced, reasoning_budget),
        }

    def parse(self, text: str, tools: Sequence[ToolSpec]) -> ParsedCalls:
        """The calls to `tools` in a whole output, and the text around them.

        A call counts only when its JSON is complete, names one of `tools` and has an object
        for arguments; anything else stays in the content as it was. The content drops each
        call with the whitespace around it; text left on both sides is joined by the
        whitespace that stood before the call (or after it, when none stood before).
        """
        segments, _ = self._scan(text, _by_name(tools), final=True, memo={}, offset=0)
        content, calls = _Content(self.separator), []
        pieces = []
        for segment in segments:
            if isinstance(segment, str):
                pieces.append(content.add(segment))
            else:
                calls += [ToolCall(id=_call_id(), name=n, arguments=a) for n, a in segment]
                content.call()
        pieces.append(content.finish())
        return ParsedCalls("".join(pieces), calls)

    def stream(self, tools: Sequence[ToolSpec]) -> ToolCallStream:
        """A parser for this family's output as it streams."""
        return ToolCallStream(self, tools)

    def _tag(self, tool: ToolSpec) -> dict:
        begin = f'{self.begin}{json.dumps(tool.name)}, "{self.argument_key}": '
        schema = {
            "type": "json_schema",
            "json_schema": _object_schema(tool),
            # JSON's whitespace is free; a model (a random one surely) can fill max_tokens
            # with it inside a call that then never closes
            "max_whitespace_cnt": MAX_WHITESPACE_RUN,
        }
        return {"type": "tag", "begin": begin, "content": schema, "end": self.end}

    def _scan(
        self, text: str, tools: dict[str, ToolSpec], final: bool, memo: dict, offset: int
    ) -> tuple[list[str | tuple[tuple[str, str], ...]], int]:
        """Text runs and call groups of `text`, up to where they are known (all of it when
        `final`). `memo` keeps JSON read so far, by position (text starts at `offset`)."""
        if not tools:
            return [text], len(text)
        segments: list[str | tuple[tuple[str, str], ...]] = []
        reader = _Reader(text, offset, memo)
        done = scan = 0
        while (hit := self._trigger_pattern.search(text, scan)) is not None:
            at = hit.start()
            verdict = self._match(text, at, final, reader, tools)
            if verdict.more:
                if not final:
                    _add_text(segments, text[done:at])
                    return segments, at
                verdict = _Verdict(len(text))  # cut short: it was text
            if verdict.calls:
                _add_text(segments, text[done:at])
                segments.append(verdict.calls)
                done = verdict.end
            scan = verdict.end
        ready = len(text) if final else len(text) - self._partial_trigger(text, scan)
        _add_text(segments, text[done:ready])
        return segments, ready

    @property
    def _trigger_pattern(self) -> regex.Pattern:
        return _TRIGGER_PATTERNS[self.name]

    def _partial_trigger(self, text: str, scan: int) -> int:
        """The length of the longest end of text[scan:] that is a proper start of a trigger."""
        longest = min(len(text) - scan, max(len(t) for t in self.triggers) - 1)
        for size in range(longest, 0, -1):
            tail = text[len(text) - size :]
            if any(len(t) > size and t.startswith(tail) for t in self.triggers):
                return size
        return 0

    def _match(
        self, text: str, at: int, final: bool, reader: _Reader, tools: dict[str, ToolSpec]
    ) -> _Verdict:
        raise NotImplementedError


@dataclass(frozen=True)
class _Hermes(ToolFormat):
    """`<tool_call>` {"name": ..., "arguments": {...}} `</tool_call>`; the closing tag may be
    missing at the very end of the output (models often stop there)."""

    def _match(
        self, text: str, at: int, final: bool, reader: _Reader, tools: dict[str, ToolSpec]
    ) -> _Verdict:
        opening, start, end, verdict = _opening_json(_HERMES_OPEN, text, at, final, reader)
        if verdict is not None:
            return verdict
        call = _call_of(reader.value(start, end), tools)
        if call is None:
            return _Verdict(end)
        closing = _HERMES_CLOSE.match(text, end, partial=True)
        if closing is None:
            return _Verdict(end)
        if not closing.partial:
            return _Verdict(closing.end(), (call,))
        return _Verdict(len(text), (call,)) if final else _UNDECIDED


@dataclass(frozen=True)
class _Llama3(ToolFormat):
    """A bare {"name": ..., "parameters": {...}} (or a list of them), after an optional
    `<|python_tag|>`; calls separated by ";" or newlines."""

    def _match(
        self, text: str, at: int, final: bool, reader: _Reader, tools: dict[str, ToolSpec]
    ) -> _Verdict:
        pattern = _LLAMA_OPENINGS[text[at]]
        at_opening = pattern is not _LLAMA_TAG  # a bare object starts where its opening does
        _, start, end, verdict = _opening_json(pattern, text, at, final, reader, at_opening)
        if verdict is not None:
            return verdict
        return _Verdict(end, _calls_in(reader.value(start, end), tools))


@dataclass(frozen=True)
class _Mistral(ToolFormat):
    """`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]NAME[ARGS]{...}`."""

    def _match(
        self, text: str, at: int, final: bool, reader: _Reader, tools: dict[str, ToolSpec]
    ) -> _Verdict:
        opening, start, end, verdict = _opening_json(_MISTRAL_OPEN, text, at, final, reader)
        if verdict is not None:
            return verdict
        value, name = reader.value(start, end), opening.group(1)
        if name is None:  # [TOOL_CALLS] [...]
            return _Verdict(end, _calls_in(value, tools, "id") if isinstance(value, list) else ())
        return _Verdict(end, _call(name, value) if name in tools and value is not None else ())


def _opening_json(
    pattern: regex.Pattern,
    text: str,
    at: int,
    final: bool,
    reader: _Reader,
    at_opening: bool = False,
) -> tuple[regex.Match | None, int, int, _Verdict | None]:
    """A family's opening at `at` and the JSON value after it (starting at the opening's last
    character, or at `at` itself): (opening, start, end, None) once both are whole, else a
    verdict to return now (no call here, or undecided until more text comes)."""
    opening = pattern.match(text, at, partial=not final)
    if opening is None:
        return None, 0, 0, _Verdict(at + 1)
    if opening.partial:
        return opening, 0, 0, _UNDECIDED
    start = at if at_opening else opening.end() - 1
    end = reader.json_end(start)
    if end is None:
        return opening, start, 0, _Verdict(at + 1)
    if end < 0:
        return opening, start, 0, _UNDECIDED
    return opening, start, end, None


class ToolCallStream:
    """Takes the calls out of an output as it streams. Holds back only text that may still
    start a call (or whitespace the content drops around one); gives a call (CallStart, then
    its arguments) once it is complete. The pieces add up to what `parse` gives."""

    def __init__(self, tool_format: ToolFormat, tools: Sequence[ToolSpec]) -> None:
        self.format = tool_format
        self.tools = _by_name(tools)
        self._buffer = ""  # text not yet taken apart
        self._offset = 0  # where the buffer starts in the output
        self._memo: dict[int, _JsonPrefix | _Inner] = {}
        self._memo_kept = 0  # entries after the last filtering
        self._content = _Content(tool_format.separator)
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
        segments, done = self.format._scan(
            self._buffer, self.tools, final, self._memo, self._offset
        )
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
                events += [CallStart(index, _call_id(), name), ArgumentsDelta(index, arguments)]
        return events


def tool_format(name: str) -> ToolFormat:
    """The tool call format called `name` (or one of its aliases)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _FORMATS:
        aliases = ", ".join(f"{a} ({b})" for a, b in _ALIASES.items())
        raise UnknownToolFormat(
            f"unknown tool call parser {name!r}; known: {', '.join(FORMAT_NAMES)} "
            f"(aliases: {aliases})"
        )
    return _FORMATS[key]


def detect_tool_format(chat_template: str | None) -> str:
    """The tool call format a chat template writes; "hermes" when it shows none."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3"
    return "hermes"


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (in a jinja expression or statement)."""
    return any(
        _TOOLS_WORD.search(_STRING_LITERAL.sub("", code.group()))
        for code in _JINJA_CODE.finditer(chat_template or "")
    )


def answer_after_reasoning(
    answer: dict | None,
    reasoning: ReasoningFormat,
    in_reasoning: bool,
    reasoning_budget: int | None = None,
) -> dict:
    """A structural tag for a reasoning block, then `answer` (an xgrammar format, such as a
    json_schema one; None: free text): a response_format applied after the thinking, not
    inside it. `reasoning_budget`: the most tokens the block may take before it is closed."""
    body = answer if answer is not None else {"type": "any_text", "excludes": [reasoning.begin]}
    return {
        "type": "structural_tag",
        "format": _after_reasoning(
            body, reasoning, in_reasoning, answer is not None, reasoning_budget
        ),
    }


def answer_format(constraint: Constraint) -> dict:
    """A constraint as a structural tag's part: the answer after a reasoning block."""
    if constraint.json_schema is not None:
        return {
            "type": "json_schema",
            "json_schema": constraint.json_schema,
            "max_whitespace_cnt": MAX_WHITESPACE_RUN,
        }
    if constraint.regex is not None:
        return {"type": "regex", "pattern": constraint.regex}
    if constraint.choices is not None:
        choices = [{"type": "const_string", "value": c} for c in constraint.choices]
        return {"type": "or", "elements": choices}
    if constraint.grammar is not None:
        return {"type": "grammar", "grammar": constraint.grammar}
    return constraint.structural_tag["format"]


def output_constraint(
    fmt: ToolFormat | None,
    tools: Sequence[ToolSpec],
    choice: str,
    parallel: bool,
    answer: Constraint | None,
    reasoning: ReasoningFormat | None,
    in_reasoning: bool,
    reasoning_budget: int | None = None,
) -> Constraint | None:
    """What one output decodes under: calls to `tools` in `fmt` (choice "none": text that
    starts no call, or `answer`), else `answer`; after the reasoning block when `reasoning` is
    given and something constrains the output. The OpenAI route and the language both ask here.
    Bad tools are InvalidTools."""
    answer_part = None if answer is None else answer_format(answer)
    if tools:
        tag = fmt.structural_tag(
            tools, choice, parallel, reasoning, in_reasoning, answer_part, reasoning_budget
        )
        return Constraint(structural_tag=tag)
    if reasoning is not None and (answer is not None or reasoning_budget is not None):
        tag = answer_after_reasoning(answer_part, reasoning, in_reasoning, reasoning_budget)
        return Constraint(structural_tag=tag)
    return answer


def _after_reasoning(
    body: dict,
    reasoning: ReasoningFormat | None,
    in_reasoning: bool,
    forced: bool,
    budget: int | None = None,
) -> dict:
    """`body` after a reasoning block: one that continues (the prompt opened it) or an
    optional one. `forced`: body must come right after the block (a newline or two aside)."""
    if reasoning is None:
        return body
    block: dict = {
        "type": "tag",
        "begin": "" if in_reasoning else reasoning.begin,
        "content": {"type": "any_text", "excludes": [reasoning.begin, reasoning.end]},
        "end": reasoning.end,
    }
    if budget is not None:  # xgrammar closes the block once it is this many tokens long
        block["content"]["max_tokens"] = budget
    if not in_reasoning:
        block = {"type": "optional", "content": block}
    elements = [block, _AFTER_REASONING, body] if forced else [block, body]
    return {"type": "sequence", "elements": elements}


def _checked(tools: Sequence[ToolSpec]) -> list[ToolSpec]:
    """`tools`, refused when a name is not a function name or is given twice."""
    tools, seen = list(tools), set()
    for tool in tools:
        if not isinstance(tool.name, str) or not _TOOL_NAME.match(tool.name):
            raise InvalidTools(
                f"tool name {tool.name!r} is not a function name ({TOOL_NAME_PATTERN})"
            )
        if tool.name in seen:
            raise InvalidTools(f"tool {tool.name!r} is given twice")
        seen.add(tool.name)
        _object_schema(tool)
    return tools


def _object_schema(tool: ToolSpec) -> dict:
    """The tool's parameters schema, held to a JSON object (arguments must be one)."""
    schema = tool.parameters
    if not isinstance(schema, dict):
        raise InvalidTools(f"the parameters of tool {tool.name!r} are not a JSON schema")
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidTools(
            f"the parameters of tool {tool.name!r} must be an object schema, not type {kind!r}"
        )
    if nests_deeper(schema):  # before anything recurses through it (as json_schema's check)
        raise InvalidTools(
            f"the parameters of tool {tool.name!r} nest deeper than {MAX_NESTING_DEPTH} levels "
            "of objects and lists"
        )
    return {"type": "object", **schema}


def _by_name(tools: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    return {tool.name: tool for tool in tools}


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _call(name: str, arguments: dict) -> tuple[tuple[str, str], ...]:
    """One call, arguments written as ToolCall.arguments has them; none if they cannot be
    (a lone surrogate, from a JSON escape, is no text a client can receive)."""
    text = json.dumps(arguments, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return ()
    return ((name, text),)


def _call_of(value: object, tools: dict[str, ToolSpec], *extra_keys: str) -> tuple[str, str] | None:
    """(name, arguments) of a call object {"name": ..., "arguments": {...}}, or None."""
    if not isinstance(value, dict) or value.keys() - {"name", *_ARGUMENT_KEYS, *extra_keys}:
        return None
    arguments = [value[key] for key in _ARGUMENT_KEYS if key in value]
    name = value.get("name")
    if len(arguments) != 1 or not isinstance(arguments[0], dict):
        return None
    if not isinstance(name, str) or name not in tools:  # a list or an object is no name
        return None
    call = _call(name, arguments[0])
    return call[0] if call else None


def _calls_in(value: object, tools: dict[str, ToolSpec], *extra_keys: str) -> tuple:
    """The calls a call object or a list of them is; none unless every one is a call."""
    found = value if isinstance(value, list) else [value]
    calls = [_call_of(item, tools, *extra_keys) for item in found]
    return () if None in calls or not calls else tuple(calls)


def _add_text(segments: list, text: str) -> None:
    if text:
        segments.append(text)


class _Content:
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


class _Reader:
    """Reads JSON values in a text; what it read of an unfinished one is kept in `memo` (by
    position in the whole output), so a stream reads each character once."""

    def __init__(self, text: str, offset: int, memo: dict) -> None:
        self.text, self.offset, self.memo = text, offset, memo

    def json_end(self, start: int) -> int | None:
        """Where the JSON object or array at `start` ends; -1 when it is unfinished, None when
        it is no JSON."""
        key = self.offset + start
        prefix = self.memo.get(key)
        if prefix is None:
            prefix = self.memo[key] = _JsonPrefix()
        end = prefix.read(self.text, start)
        # the values that start inside it are known with it: a later trigger there reads
        # nothing again (else text like `[{"name": ` repeated is read once per trigger)
        outer, base = prefix.outer, key - prefix.rel
        for rel in outer.inner:
            self.memo.setdefault(base + rel, _Inner(outer, rel))
        outer.inner.clear()
        return end

    def value(self, start: int, end: int) -> object:
        """The JSON value text[start:end] (read whole by json_end), or None."""
        try:
            return json.loads(self.text[start:end], strict=False)
        except (ValueError, RecursionError):  # nested past Python's recursion limit
            return None


class _Inner:
    """A JSON value that starts at a bracket inside a value being read (`rel` characters into
    it): it ends where that one closes the bracket, and while the bracket is open it fails or
    stays unfinished with it (the same characters read in the same state), so its text is
    read once, by the outer value."""

    __slots__ = ("outer", "rel")

    def __init__(self, outer: _JsonPrefix, rel: int) -> None:
        self.outer, self.rel = outer, rel

    def read(self, text: str, start: int) -> int | None:
        """As _JsonPrefix.read, for the value at `start`."""
        end = self.outer.read(text, start - self.rel)
        length = self.outer.closed.get(self.rel)
        if length is not None:
            return start + length
        return None if end is None else -1


# _JsonPrefix states
(
    _START, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _STRING, _ESCAPE,
    _HEX, _LITERAL, _MINUS, _ZERO, _INT, _DOT, _FRACTION, _E, _EXPONENT_SIGN, _EXPONENT,
) = range(19)  # fmt: skip
_DIGITS = "0123456789"
_JSON_BLANK = " \t\r\n"
# control characters are taken inside strings, as xgrammar's JSON grammar lets a model write
# them; json.loads(strict=False) reads them and json.dumps writes the arguments escaped
_PLAIN_STRING = regex.compile(r'[^"\\]*')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class _JsonPrefix:
    """Reads one JSON object or array (JSON as json.loads(strict=False) takes it: control
    characters inside strings too) a piece at a time:
    says where it ends, that it is unfinished, or that no more text can make it JSON."""

    __slots__ = (
        "read_chars", "stack", "state", "key", "need", "result", "opens", "closed", "inner",
    )  # fmt: skip
    rel = 0  # where it starts in the value it reads (itself: see _Inner)

    def __init__(self) -> None:
        self.read_chars = 0  # read so far, from the value's start
        self.stack: list[str] = []  # the open "{" and "["
        self.state = _START
        self.key = False  # the string being read is an object's key
        self.need = ""  # the rest of a literal, or as many characters as hex digits are due
        self.result: int | None = -1  # its length, -1 while unfinished, None once it is no JSON
        self.opens: list[int] = []  # where each open bracket of `stack` is, from the start
        self.closed: dict[int, int] = {}  # inner values read whole: their start -> length
        self.inner: list[int] = []  # starts of inner values opened, not yet told the reader

    @property
    def outer(self) -> _JsonPrefix:
        """The value whose reading this one's is (itself)."""
        return self

    def read(self, text: str, start: int) -> int | None:
        """Read on in `text` (the value starts at `start`): its end, -1 or None."""
        if self.result is None or self.result >= 0:
            return self.result if self.result is None else start + self.result
        i, stack, state = start + self.read_chars, self.stack, self.state
        while i < len(text):
            c = text[i]
            if state == _STRING:
                i = _PLAIN_STRING.match(text, i).end()
                if i == len(text):
                    break
                c = text[i]
                if c == '"':
                    state = _COLON if self.key else _AFTER
                else:
                    state = _ESCAPE
            elif c in _JSON_BLANK and state in (
                _START, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER,
            ):  # fmt: skip
                pass
            elif state in (_START, _VALUE, _VALUE_OR_CLOSE):
                if c == "{":
                    self._open(c, i - start)
                    state = _KEY_OR_CLOSE
                elif c == "[":
                    self._open(c, i - start)
                    state = _VALUE_OR_CLOSE
                elif state == _START:
                    return self._fail()
                elif c == "]" and state == _VALUE_OR_CLOSE:
                    if not self._close(i - start):
                        return self._done(i + 1, start)
                    state = _AFTER
                elif c == '"':
                    state, self.key = _STRING, False
                elif c == "-":
                    state = _MINUS
                elif c == "0":
                    state = _ZERO
                elif c in _DIGITS:
                    state = _INT
                elif c in _LITERALS:
                    state, self.need = _LITERAL, _LITERALS[c]
                else:
                    return self._fail()
            elif state in (_KEY_OR_CLOSE, _KEY):
                if c == '"':
                    state, self.key = _STRING, True
                elif c == "}" and state == _KEY_OR_CLOSE:
                    if not self._close(i - start):
                        return self._done(i + 1, start)
                    state = _AFTER
                else:
                    return self._fail()
            elif state == _COLON:
                if c != ":":
                    return self._fail()
                state = _VALUE
            elif state == _AFTER:
                if c == ",":
                    state = _KEY if stack[-1] == "{" else _VALUE
                elif c == ("}" if stack[-1] == "{" else "]"):
                    if not self._close(i - start):
                        return self._done(i + 1, start)
                else:
                    return self._fail()
            elif state == _ESCAPE:
                if c == "u":
                    state, self.need = _HEX, "xxxx"
                elif c in '"\\/bfnrt':
                    state = _STRING
                else:
                    return self._fail()
            elif state == _HEX:
                if c not in "0123456789abcdefABCDEF":
                    return self._fail()
                self.need = self.need[1:]
                if not self.need:
                    state = _STRING
            elif state == _LITERAL:
                if c != self.need[0]:
                    return self._fail()
                self.need = self.need[1:]
                if not self.need:
                    state = _AFTER
            elif state in (_MINUS, _DOT, _EXPONENT_SIGN):
                if c not in _DIGITS:
                    return self._fail()
                state = {_MINUS: _INT, _DOT: _FRACTION, _EXPONENT_SIGN: _EXPONENT}[state]
                if state == _INT and c == "0":
                    state = _ZERO
            elif state == _E:
                if c in "+-":
                    state = _EXPONENT_SIGN
                elif c in _DIGITS:
                    state = _EXPONENT
                else:
                    return self._fail()
            elif c in _DIGITS and state != _ZERO:
                pass  # more digits of _INT, _FRACTION or _EXPONENT
            elif c == "." and state in (_ZERO, _INT):
                state = _DOT
            elif c in "eE" and state in (_ZERO, _INT, _FRACTION):
                state = _E
            else:  # the number ended: this character comes after it
                state = _AFTER
                continue
            i += 1
        self.read_chars, self.state = i - start, state
        return -1

    def _open(self, bracket: str, at: int) -> None:
        """A bracket opens `at` characters into the value (an inner value starts there)."""
        self.stack.append(bracket)
        self.opens.append(at)
        if at:
            self.inner.append(at)

    def _close(self, at: int) -> int:
        """The innermost open bracket closes `at` characters in; how many stay open."""
        self.stack.pop()
        opened = self.opens.pop()
        if self.stack:
            self.closed[opened] = at + 1 - opened
        return len(self.stack)

    def _done(self, end: int, start: int) -> int:
        self.result = end - start  # a length: the text may be cut in front before the next read
        return end

    def _fail(self) -> None:
        self.result = None
        return None


_FORMATS: dict[str, ToolFormat] = {
    "hermes": _Hermes(
        "hermes", "<tool_call>", '<tool_call>\n{"name": ', "arguments", "}\n</tool_call>",
        joiner="\n", separator="", triggers=("<tool_call>",),
    ),
    "llama3": _Llama3(
        "llama3", '{"name": ', '{"name": ', "parameters", "}",
        joiner="; ", separator=";", triggers=("{", "[", "<|python_tag|>"),
    ),
    "mistral": _Mistral(
        "mistral", "[TOOL_CALLS]", '[TOOL_CALLS] [{"name": ', "arguments", "}]",
        joiner="", separator="", triggers=("[TOOL_CALLS]",),
    ),
}  # fmt: skip
_TRIGGER_PATTERNS = {
    name: regex.compile("|".join(regex.escape(t) for t in fmt.triggers))
    for name, fmt in _FORMATS.items()
}
_HERMES_OPEN = regex.compile(r"<tool_call>" + _BLANK + r"\{")
_HERMES_CLOSE = regex.compile(_BLANK + r"</tool_call>")
_LLAMA_TAG = regex.compile(r"<\|python_tag\|>" + _BLANK + r"[{\[]")
_LLAMA_OPENINGS = {
    "<": _LLAMA_TAG,
    "{": regex.compile(r"\{" + _BLANK + r'"name"' + _BLANK + ":"),
    "[": regex.compile(r"\[" + _BLANK + r"\{" + _BLANK + r'"name"' + _BLANK + ":"),
}
_MISTRAL_OPEN = regex.compile(
    r"\[TOOL_CALLS\]" + _BLANK + r"(?:\[|([A-Za-z0-9_.-]{1,64})"
    r"(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]" + _BLANK + r"\{)"
)
_TOOL_NAME = regex.compile(TOOL_NAME_PATTERN)
_JINJA_CODE = regex.compile(r"\{\{.*?\}\}|\{%.*?%\}", regex.S)
_TOOLS_WORD = regex.compile(r"\btools\b")
_STRING_LITERAL = regex.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", regex.S)
