"""Which rules of a compiled grammar can never end: xgrammar's jump-forward would try to force
an endless string through them (and run out of memory), so such constraints are refused.

Reads xgrammar's normalized EBNF (`str(compiled.grammar)`): one rule a line,
`name ::= (alternative) | (alternative) | ""`, each alternative a sequence of string
literals, character classes, rule names and parenthesized groups, any of them with a `*`, `+`
or `?`, optionally followed by a lookahead `(=(...))`. A rule is finite when one alternative
has only finite elements; the least fixpoint over all rules leaves the endless ones.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<name>[A-Za-z_][\w.]*)'
    r"|(?P<sym>\(=|[()|*+?]))"
)


class GrammarSyntaxUnknown(ValueError):
    """xgrammar printed something this reader does not know (the check is then skipped)."""


def endless_rules(normalized_ebnf: str) -> list[str]:
    """Names of the rules that have no finite expansion (empty: every rule can end)."""
    rules = {}
    for line in normalized_ebnf.strip().splitlines():
        name, _, body = line.partition("::=")
        rules[name.strip()] = _parse(_tokens(body))
    finite: dict[str, bool] = dict.fromkeys(rules, False)
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if not finite[name] and _finite(expr, finite):
                finite[name] = changed = True
    return [name for name, ok in finite.items() if not ok]


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
        elif kind in ("str", "cls"):
            elem, pos = ("lit",), pos + 1
        elif kind == "name":
            elem, pos = ("ref", text), pos + 1
        else:
            raise GrammarSyntaxUnknown(f"unexpected {text!r}")
        if pos < len(tokens) and tokens[pos] in (("sym", "*"), ("sym", "+"), ("sym", "?")):
            elem, pos = ("rep", tokens[pos][1], elem), pos + 1
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
