"""Where a JSON object or array in a text ends, read a piece at a time as the text streams.

Hand-written rather than a library's: a stream reads each character once (the state of an
unfinished value is kept between pieces), a value opened inside one already read is known with
it (else text like `[{"name": ` repeated is read once per bracket: quadratic), control
characters inside strings are taken (xgrammar's JSON grammar lets a model write them; json.loads
with strict=False reads them), and the end of the value is told apart from the text after it.
jiter's partial mode does none of these: it parses from the start on every call, ignores what
follows the value without saying where it ended, and refuses control characters.
"""

from __future__ import annotations

import json

import regex

# the reader's states; _FAILED, _CLOSED and _NUMBER_ENDED are what a step says, never kept
(
    _START, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER, _STRING, _ESCAPE,
    _HEX, _LITERAL, _MINUS, _ZERO, _INT, _DOT, _FRACTION, _E, _EXPONENT_SIGN, _EXPONENT,
    _FAILED, _CLOSED, _NUMBER_ENDED,
) = range(22)  # fmt: skip
_STRUCTURE = frozenset((_START, _VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER))
_DIGITS = "0123456789"
_HEX_DIGITS = "0123456789abcdefABCDEF"
_JSON_BLANK = " \t\r\n"
_PLAIN_STRING = regex.compile(r'[^"\\]*')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_NUMBER_START = {"-": _MINUS, "0": _ZERO, **dict.fromkeys("123456789", _INT)}
_CLOSER = {"{": "}", "[": "]"}
# what a digit moves a state that needs one to
_AFTER_DIGIT = {_DOT: _FRACTION, _EXPONENT_SIGN: _EXPONENT}


class JsonReader:
    """Reads JSON values in a text; what it read of an unfinished one is kept in `memo` (by
    position in the whole output), so a stream reads each character once."""

    def __init__(self, text: str, offset: int, memo: dict[int, _JsonPrefix | _Inner]) -> None:
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
        i, state = start + self.read_chars, self.state
        while i < len(text):
            c = text[i]
            if state == _STRING:
                i = _PLAIN_STRING.match(text, i).end()  # the plain run at once, not by character
                if i == len(text):
                    break
                state = (_COLON if self.key else _AFTER) if text[i] == '"' else _ESCAPE
            elif state in _STRUCTURE:
                if c not in _JSON_BLANK:
                    state = self._structure(c, state, i - start)
            else:
                state = self._scalar(c, state)
                if state == _NUMBER_ENDED:  # this character comes after the number
                    state = _AFTER
                    continue
            if state == _FAILED:
                self.result = None
                return None
            if state == _CLOSED:
                self.result = i + 1 - start  # a length: the text may be cut in front before
                return i + 1  # the next read
            i += 1
        self.read_chars, self.state = i - start, state
        return -1

    def _structure(self, c: str, state: int, at: int) -> int:
        """The state after `c` (no blank), `at` characters in, between values and keys."""
        if state == _COLON:
            return _VALUE if c == ":" else _FAILED
        if state == _AFTER:
            if c == ",":
                return _KEY if self.stack[-1] == "{" else _VALUE
            return self._close(at) if c == _CLOSER[self.stack[-1]] else _FAILED
        if state in (_KEY_OR_CLOSE, _KEY):
            if c == '"':
                self.key = True
                return _STRING
            return self._close(at) if c == "}" and state == _KEY_OR_CLOSE else _FAILED
        if c in _CLOSER:
            self._open(c, at)
            return _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        if state == _START:  # an object or an array, nothing else
            return _FAILED
        if c == "]" and state == _VALUE_OR_CLOSE:
            return self._close(at)
        if c == '"':
            self.key = False
            return _STRING
        if c in _LITERALS:
            self.need = _LITERALS[c]
            return _LITERAL
        return _NUMBER_START.get(c, _FAILED)

    def _scalar(self, c: str, state: int) -> int:
        """The state after `c` inside an escape, a literal or a number."""
        if state == _ESCAPE:
            if c == "u":
                self.need = "xxxx"
                return _HEX
            return _STRING if c in '"\\/bfnrt' else _FAILED
        if state == _HEX or state == _LITERAL:
            wrong = c not in _HEX_DIGITS if state == _HEX else c != self.need[0]
            if wrong:
                return _FAILED
            self.need = self.need[1:]
            if self.need:
                return state
            return _STRING if state == _HEX else _AFTER
        return _number(c, state)

    def _open(self, bracket: str, at: int) -> None:
        """A bracket opens `at` characters into the value (an inner value starts there)."""
        self.stack.append(bracket)
        self.opens.append(at)
        if at:
            self.inner.append(at)

    def _close(self, at: int) -> int:
        """The innermost open bracket closes `at` characters in: the state after it."""
        self.stack.pop()
        opened = self.opens.pop()
        if not self.stack:
            return _CLOSED
        self.closed[opened] = at + 1 - opened
        return _AFTER


def _number(c: str, state: int) -> int:
    """The state after `c` inside a number (_NUMBER_ENDED: the number ended before `c`)."""
    if state in (_MINUS, _DOT, _EXPONENT_SIGN):
        if c not in _DIGITS:
            return _FAILED
        if state == _MINUS:
            return _ZERO if c == "0" else _INT
        return _AFTER_DIGIT[state]
    if state == _E:
        if c in "+-":
            return _EXPONENT_SIGN
        return _EXPONENT if c in _DIGITS else _FAILED
    if c in _DIGITS and state != _ZERO:
        return state  # more digits of _INT, _FRACTION or _EXPONENT
    if c == "." and state in (_ZERO, _INT):
        return _DOT
    if c in "eE" and state in (_ZERO, _INT, _FRACTION):
        return _E
    return _NUMBER_ENDED
