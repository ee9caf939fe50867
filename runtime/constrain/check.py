"""Checks on constraints: how deep a JSON value nests (before anything recurses through it), and
which rules of a compiled grammar can never end: xgrammar's jump-forward would try to force
an endless string through them (and run out of memory), so such constraints are refused.

Reads xgrammar's normalized EBNF (`str(compiled.grammar)`): one rule a line,
`name ::= (alternative) | (alternative) | ""`, each alternative a sequence of string
literals, character classes, rule names and parenthesized groups, any of them with a `*`, `+`
or `?` (or `{min, max}`), optionally followed by a lookahead `(=(...))`; a JSON string's
pattern is `Regex("...", json_string=true)` and a tool grammar's dispatch on its triggers is a
rule `TagDispatch(...)` over several lines (both can end: the groups a dispatch names are rules
of their own, checked like any other). A rule is finite when one alternative has only finite
elements; the least fixpoint over all rules leaves the endless ones.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])'
    r'|(?P<regex>Regex\("(?:[^"\\]|\\.)*"(?:,\s*json_string=(?:true|false))?\))'
    r"|(?P<name>[A-Za-z_][\w.]*)|(?P<count>\{\s*\d+\s*(?:,\s*\d*\s*)?\})|(?P<sym>\(=|[()|*+?]))"
)
_RULE_START = re.compile(r"^([A-Za-z_][\w.]*) ::= ", re.M)
_DISPATCH = "TagDispatch("
MAX_NESTING_DEPTH = 64  # objects and lists in a JSON schema, a tool's parameters, call arguments


def nests_deeper(value: object, limit: int = MAX_NESTING_DEPTH) -> bool:
    """Whether `value` (JSON: dicts, lists, scalars) nests more than `limit` levels of dicts and
    lists below its top; level by level, so it never recurses (the value may be any depth)."""
    level: list = [value] if isinstance(value, dict | list) else []
    for _ in range(limit + 1):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
        if not level:
            return False
    return True


class GrammarSyntaxUnknown(ValueError):
    """xgrammar printed something this reader does not know (the check is then skipped)."""


def endless_rules(normalized_ebnf: str) -> list[str]:
    """Names of the rules that have no finite expansion (empty: every rule can end)."""
    rules = {}
    for name, body in _rules(normalized_ebnf):
        # a dispatch can always end (free text); its groups are rules checked on their own
        rules[name] = ("lit",) if body.lstrip().startswith(_DISPATCH) else _parse(_tokens(body))
    finite: dict[str, bool] = dict.fromkeys(rules, False)
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if not finite[name] and _finite(expr, finite):
                finite[name] = changed = True
    return [name for name, ok in finite.items() if not ok]


def _rules(normalized_ebnf: str) -> list[tuple[str, str]]:
    """(name, body) of each rule; a body may span several lines (a TagDispatch does)."""
    starts = list(_RULE_START.finditer(normalized_ebnf))
    if not starts or normalized_ebnf[: starts[0].start()].strip():
        raise GrammarSyntaxUnknown("no rule at the start")
    ends = [m.start() for m in starts[1:]] + [len(normalized_ebnf)]
    return [
        (m.group(1), normalized_ebnf[m.end() : end]) for m, end in zip(starts, ends, strict=True)
    ]


def _tokens(body: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(body.rstrip()):
        match = _TOKEN.match(body, pos)
        if match is None:
            raise GrammarSyntaxUnknown(f"unexpected text: {body[pos : pos + 20]!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def _parse(tokens: list[tuple[str, str]]) -> tuple:
    """An expression tree: ("alt", [seq...]), ("seq", [elem...]), ("rep", q, elem),
    ("lit",), ("ref", name); lookaheads are dropped (they consume nothing)."""
    expr, pos = _alternation(tokens, 0)
    if pos != len(tokens):
        raise GrammarSyntaxUnknown(f"trailing tokens: {tokens[pos:][:3]}")
    return expr


def _alternation(tokens: list, pos: int) -> tuple[tuple, int]:
    seqs = []
    while True:
        seq, pos = _sequence(tokens, pos)
        seqs.append(seq)
        if pos < len(tokens) and tokens[pos] == ("sym", "|"):
            pos += 1
            continue
        return ("alt", seqs), pos


def _sequence(tokens: list, pos: int) -> tuple[tuple, int]:
    elems = []
    while pos < len(tokens) and tokens[pos] not in (("sym", "|"), ("sym", ")")):
        kind, text = tokens[pos]
        if (kind, text) == ("sym", "(="):  # a lookahead: parse it, keep nothing
            _, pos = _alternation(tokens, pos + 1)
            pos = _expect(tokens, pos, ")")
            continue
        if (kind, text) == ("sym", "("):
            elem, pos = _alternation(tokens, pos + 1)
            pos = _expect(tokens, pos, ")")
        elif kind in ("str", "cls", "regex"):
            elem, pos = ("lit",), pos + 1
        elif kind == "name":
            elem, pos = ("ref", text), pos + 1
        else:
            raise GrammarSyntaxUnknown(f"unexpected {text!r}")
        if pos < len(tokens) and tokens[pos] in (("sym", "*"), ("sym", "+"), ("sym", "?")):
            elem, pos = ("rep", tokens[pos][1], elem), pos + 1
        elif pos < len(tokens) and tokens[pos][0] == "count":  # {min, max}: like * or +
            at_least = int(tokens[pos][1].strip("{} ").split(",")[0])
            elem, pos = ("rep", "+" if at_least else "*", elem), pos + 1
        elems.append(elem)
    return ("seq", elems), pos


def _expect(tokens: list, pos: int, symbol: str) -> int:
    if pos >= len(tokens) or tokens[pos] != ("sym", symbol):
        raise GrammarSyntaxUnknown(f"expected {symbol!r}")
    return pos + 1


def _finite(expr: tuple, finite: dict[str, bool]) -> bool:
    kind = expr[0]
    if kind == "alt":
        return any(_finite(seq, finite) for seq in expr[1])
    if kind == "seq":
        return all(_finite(elem, finite) for elem in expr[1])
    if kind == "rep":
        return expr[1] in "*?" or _finite(expr[2], finite)
    if kind == "ref":
        return finite.get(expr[1], True)  # a name we never saw: assume it can end
    return True  # a literal or a character class
