"""stop_regex matched in time linear in the text: a Pike VM (a Thompson NFA run with every
thread in step) fed the generated text as it grows.

A backtracking engine (re, regex) takes exponential time on patterns such as `(a|a)+b` over a
run of `a`s, and a stop_regex is checked after every token on the engine's thread: one request
could stall every other. Here a pattern is compiled (by Python's own regex parser, so the syntax
and its errors are `re`'s) to a program of character tests, splits, jumps and assertions; each
character of text advances every live thread one step, so a character costs at most the
program's length in steps, whatever the pattern. Threads live across tokens, so each character
is read once. A piece of text (a token's) may be read in many calls, each within a budget of
steps (begin(), advance()): the engine bounds a request's matching per step this way, however
much text a grammar forced in one step, and finds what one unbounded feed() finds.

Threads run in priority order, which gives `re`'s leftmost-first matches; a match must be
non-empty: where re's match at a position is empty, none begins there (as searching again
from the next position would find). What a finite automaton cannot do is refused with
StopRegexError: backreferences, lookaround, conditionals, atomic groups, possessive repeats,
and a program longer than MAX_PROGRAM_LEN (a bounded repeat is copied out: `a{1000}` is 1,000
steps). `$` before a final newline means the final newline of the text so far.
"""

from __future__ import annotations

import math
import re
import re._compiler as re_compiler  # re's own parser and compiler (3.11+): re's exact syntax
import re._constants as c
import re._parser as re_parser
from collections.abc import Callable

from runtime.errors import InvalidRequestError

MAX_PROGRAM_LEN = 2048  # instructions, for all of one request's patterns together

CHAR, SPLIT, JMP, ASSERT, MATCH = range(5)
# (CHAR, test) | (SPLIT, preferred, other) | (JMP, to) | (ASSERT, at, flags) | (MATCH,)
Instruction = tuple
Thread = tuple[int, int]  # (program counter, where its match began)


class StopRegexError(InvalidRequestError):
    """A stop_regex this matcher cannot run in linear time (or at all)."""


def compile_program(pattern: str, max_len: int = MAX_PROGRAM_LEN) -> list[Instruction]:
    """The program of `pattern`; StopRegexError if it has what an automaton cannot do or
    would be longer than `max_len` instructions."""
    try:
        parsed = re_parser.parse(pattern)
    except re.error as err:
        raise StopRegexError(f"invalid stop_regex {pattern!r}: {err}") from err
    return _Compiler(pattern, parsed.state.flags, max_len).program(parsed)


class _Compiler:
    """re's parse tree -> a program (emitted in order, split targets patched afterwards)."""

    def __init__(self, pattern: str, flags: int, max_len: int) -> None:
        self.pattern = pattern
        self.flags = flags
        self.max_len = max_len
        self.prog: list[list] = []

    def program(self, parsed: re_parser.SubPattern) -> list[Instruction]:
        self.emit_all(parsed, self.flags)
        self.emit(MATCH)
        return [tuple(i) for i in self.prog]

    def emit(self, *instruction: object) -> int:
        if len(self.prog) >= self.max_len:
            raise StopRegexError(
                f"stop_regex {self.pattern!r} needs more automaton states than the request "
                f"has left ({self.max_len:,} of {MAX_PROGRAM_LEN:,} for all its patterns; "
                "bounded repeats such as x{1000} are copied out): shorten it"
            )
        self.prog.append(list(instruction))
        return len(self.prog) - 1

    def emit_all(self, nodes: re_parser.SubPattern | list, flags: int) -> None:
        for op, arg in nodes:
            self.emit_node(op, arg, flags)

    def emit_node(self, op: object, arg: object, flags: int) -> None:
        if op in (c.LITERAL, c.NOT_LITERAL, c.ANY, c.IN):
            self.emit(CHAR, _char_test(op, arg, flags))
        elif op is c.SUBPATTERN:
            _, add_flags, del_flags, body = arg
            self.emit_all(body, (flags | add_flags) & ~del_flags)
        elif op is c.BRANCH:
            self.emit_branch(arg[1], flags)
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, body = arg
            self.emit_repeat(low, high, body, flags, greedy=op is c.MAX_REPEAT)
        elif op is c.AT:
            self.emit(ASSERT, arg, flags)
        else:
            raise StopRegexError(
                f"stop_regex {self.pattern!r} uses {_NAMES.get(op, str(op).lower())}, which "
                "cannot be matched in linear time; use a plain regular expression"
            )

    def emit_branch(self, alternatives: list, flags: int) -> None:
        # SPLIT(a, next) a JMP(end) SPLIT(b, next) b JMP(end) ... last
        jumps = []
        for alt in alternatives[:-1]:
            split = self.emit(SPLIT, None, None)
            self.prog[split][1] = len(self.prog)
            self.emit_all(alt, flags)
            jumps.append(self.emit(JMP, None))
            self.prog[split][2] = len(self.prog)
        self.emit_all(alternatives[-1], flags)
        for jump in jumps:
            self.prog[jump][1] = len(self.prog)

    def emit_repeat(self, low: int, high: object, body: list, flags: int, greedy: bool) -> None:
        for _ in range(low):
            self.emit_all(body, flags)
        if high is c.MAXREPEAT:  # L: SPLIT(body, end) body JMP(L)
            loop = self.emit(SPLIT, None, None)
            self.prog[loop][1 if greedy else 2] = len(self.prog)
            self.emit_all(body, flags)
            self.emit(JMP, loop)
            self.prog[loop][2 if greedy else 1] = len(self.prog)
            return
        splits = []  # each optional copy may be skipped to the end
        for _ in range(high - low):
            split = self.emit(SPLIT, None, None)
            self.prog[split][1 if greedy else 2] = len(self.prog)
            splits.append(split)
            self.emit_all(body, flags)
        for split in splits:
            self.prog[split][2 if greedy else 1] = len(self.prog)


_NAMES = {
    c.GROUPREF: "a backreference",
    c.GROUPREF_EXISTS: "a conditional group",
    c.ASSERT: "a lookahead or lookbehind",
    c.ASSERT_NOT: "a negative lookahead or lookbehind",
    c.ATOMIC_GROUP: "an atomic group",
    c.POSSESSIVE_REPEAT: "a possessive repeat",
}


def _char_test(op: object, arg: object, flags: int) -> Callable[[str], bool]:
    """Whether a character matches one character node (re's own compiled test, except for
    the plain literal)."""
    if op is c.LITERAL and not flags & re.IGNORECASE:
        literal = chr(arg)
        return literal.__eq__
    node = re_parser.SubPattern(re_parser.State(), [(op, arg)])
    test = re_compiler.compile(node, flags).match
    return lambda ch: test(ch) is not None


class _FinalNewline(str):
    """The newline that ends the text so far (where `$` holds, as re's `$` before a final
    newline)."""


_FINAL_NEWLINE = _FinalNewline("\n")


def _is_word(ch: str | None, ascii_only: bool) -> bool:
    if ch is None:
        return False
    if ascii_only:
        return ch.isascii() and (ch.isalnum() or ch == "_")
    return ch.isalnum() or ch == "_"


class StopRegexMatcher:
    """One pattern over a growing text: feed() the new characters; the earliest non-empty
    match so far (leftmost-first, as re.search on the text so far), and where a match could
    still begin.

    >>> matcher = StopRegexMatcher(r"\\d+\\.\\d+")
    >>> matcher.feed("Total 12."), matcher.search_from
    (None, 6)
    >>> matcher.feed("5 USD")
    (6, 10)
    """

    def __init__(self, pattern: str, max_len: int = MAX_PROGRAM_LEN) -> None:
        self.pattern = pattern
        self.prog = compile_program(pattern, max_len)
        self._pending: list[Thread] = []  # at position `num_fed`, before their next step
        self.num_fed = 0  # characters fed so far
        self._last_char: str | None = None
        self.num_steps = 0  # threads advanced or followed, all feeds together (cost)
        self._piece = ""  # the text begun, read up to `_index` (advance() reads on)
        self._index = 0
        self._end = 0  # where the piece ends in the whole text
        self._match: tuple[int, int] | None = None  # the best match so far in the piece
        self.found: tuple[int, int] | None = None  # the match once the piece is read
        self._reading = False  # begun and not read to its end

    @property
    def search_from(self) -> int:
        """No match can begin before this position any more (text before it may stream),
        nor did the one found, if any (a piece read in many calls: found before its end)."""
        starts = [start for _, start in self._pending]
        found = self._match or self.found
        if found is not None:
            starts.append(found[0])
        return min(starts, default=self.num_fed)

    def skip(self, text: str) -> None:
        """Pass over `text` (nothing in it may begin a match: before min_new_tokens)."""
        self.found = None
        if text:
            self._pending = []
            self.num_fed += len(text)
            self._last_char = text[-1]

    def feed(self, text: str) -> tuple[int, int] | None:
        """Read `text` (what follows what was fed); (start, end) of the match in the whole
        text so far, or None."""
        self.begin(text)
        self.advance(math.inf)
        return self.found

    def begin(self, text: str) -> None:
        """Start reading `text` (what follows what was fed) as one piece: the text so far is
        searched as it stands at the piece's end, as feed(text) would; advance() reads it."""
        self._piece, self._index, self._end = text, 0, self.num_fed + len(text)
        self._match = self.found = None
        self._reading = True

    def advance(self, budget: float) -> bool:
        """Read on in the piece until its end, or until `budget` steps are spent (a step
        more at most: one character's closure, or the end's); True once it is read, and
        `found` is then feed()'s answer. Pieces read in many calls find what one call finds."""
        if not self._reading:
            return True
        limit = self.num_steps + budget
        piece, i, end, prog = self._piece, self._index, self._end, self.prog
        pending, pos, prev, match = self._pending, self.num_fed, self._last_char, self._match
        while i < len(piece) and self.num_steps < limit:
            ch = piece[i]
            nxt = ch if pos + 1 < end or ch != "\n" else _FINAL_NEWLINE
            threads, found = self._closure(pending, pos, prev, nxt, new_start=match is None)
            match = found or match
            pending = [(pc + 1, start) for pc, start in threads if prog[pc][1](ch)]
            self.num_steps += len(threads)
            pos, prev, i = pos + 1, ch, i + 1
            if not pending and match is not None:
                i = len(piece)  # nothing left that could make the match longer: it stops
        self._pending, self.num_fed, self._last_char = pending, pos, prev
        self._index, self._match = i, match
        if i < len(piece):
            return False
        _, found = self._closure(pending, pos, prev, None, new_start=match is None)
        self.found, self._match, self._piece, self._index = found or match, None, "", 0
        self._reading = False
        return True

    def _closure(
        self, pending: list[Thread], pos: int, prev: str | None, nxt: str | None, new_start: bool
    ) -> tuple[list[Thread], tuple[int, int] | None]:
        """Follow splits, jumps and assertions at `pos` (between `prev` and `nxt`, None for
        the text's ends) from each thread in priority order, then a new one beginning here:
        the threads now at a character test, and the best match reached (a non-empty match
        drops every thread after it)."""
        prog, visited = self.prog, set()
        threads: list[Thread] = []
        starts = [*pending, (0, pos)] if new_start else pending
        for thread in starts:
            stack = [thread]
            while stack:
                pc, start = stack.pop()
                if pc in visited:
                    continue
                visited.add(pc)
                self.num_steps += 1
                op = prog[pc]
                kind = op[0]
                if kind == CHAR:
                    threads.append((pc, start))
                elif kind == SPLIT:
                    stack += ((op[2], start), (op[1], start))  # the preferred one first
                elif kind == JMP:
                    stack.append((op[1], start))
                elif kind == ASSERT:
                    if _holds(op[1], op[2], pos, prev, nxt):
                        stack.append((pc + 1, start))
                elif start < pos:  # MATCH, non-empty: lower-priority threads are dropped
                    return threads, (start, pos)
                else:  # empty: re's match here, unless a thread it preferred (already in
                    stack.clear()  # `threads`) matches later; its lower alternatives never
        return threads, None


def _holds(at: object, flags: int, pos: int, prev: str | None, nxt: str | None) -> bool:
    """Whether an assertion holds at `pos`, between `prev` and `nxt` (None: the text's ends;
    _FINAL_NEWLINE: the newline that ends the text so far)."""
    if at is c.AT_BEGINNING_STRING:
        return pos == 0
    if at is c.AT_BEGINNING:
        return pos == 0 or (bool(flags & re.MULTILINE) and prev == "\n")
    if at is c.AT_END_STRING:
        return nxt is None
    if at is c.AT_END:
        return nxt is None or nxt is _FINAL_NEWLINE or (bool(flags & re.MULTILINE) and nxt == "\n")
    ascii_only = bool(flags & re.ASCII)
    boundary = _is_word(prev, ascii_only) != _is_word(nxt, ascii_only)
    return boundary == (at is c.AT_BOUNDARY)  # else AT_NON_BOUNDARY
