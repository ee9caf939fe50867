"""Endless grammar rules are found in xgrammar's normalized EBNF; grammars that can end pass."""

from __future__ import annotations

import pytest

from runtime.constrain.check import GrammarSyntaxUnknown, endless_rules


@pytest.mark.parametrize(
    ("ebnf", "endless"),
    [
        ('root ::= (("a" root))', ["root"]),
        ('root ::= (("ab" root) | ("c" root))', ["root"]),
        ('root ::= (("x" b))\nb ::= (("y" root))', ["root", "b"]),
        ('root ::= (("x") | ("y" loop))\nloop ::= (("z" loop))', ["loop"]),
        ('root ::= ((loop+))\nloop ::= (("z" loop))', ["root", "loop"]),
        ('root ::= ((loop*))\nloop ::= (("z" loop))', ["loop"]),
        ('root ::= (("a" root) | (""))', []),
        ('root ::= (([0-9] root) | ([0-9])) (=([a-z]* tail))\ntail ::= ("" | ("x"))', []),
        ('s ::= (("\\"" s_sub))\ns_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\] s_sub))', []),
        ('root ::= (((("a" | "b") root)?))', []),
    ],
)
def test_endless_rules(ebnf, endless):
    assert endless_rules(ebnf) == endless


def test_unknown_syntax_is_reported_not_guessed():
    with pytest.raises(GrammarSyntaxUnknown):
        endless_rules("root ::= (( @weird ))")
