"""Constrained output stays valid UTF-8 where xgrammar would let a surrogate through."""

from __future__ import annotations

import json

import pytest

from runtime.constrain.utf8_guard import Utf8Guard


def test_xgrammar_still_accepts_an_encoded_surrogate_in_a_json_string():
    """Why the guard exists: if a later xgrammar refuses ED A0 80, the guard may go."""
    xgr = pytest.importorskip("xgrammar")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(["a"] * 8))
    matcher = xgr.GrammarMatcher(
        compiler.compile_json_schema(json.dumps({"type": "string", "maxLength": 1}))
    )
    assert matcher._handle.accept_string(b'"\xed\xa0\x80"', False)


def test_the_guard_blocks_surrogate_bytes_and_only_them():
    vocab = [b"\xed", b"\xa0\x80", b"\x80\x80", b"a\xed\xa0", b"x", b"\xed\x9f\xbf", b""]
    guard = Utf8Guard(vocab, len(vocab))
    assert guard.never.tolist() == [False, False, False, True, False, False, False]
    assert guard.after_lead.tolist() == [False, True, False, False, False, False, False]
    assert guard.ends_on_lead(0) and not guard.ends_on_lead(5) and not guard.ends_on_lead(None)
    # after ED: A0-BF (a surrogate) is blocked, 80-9F (U+D000-D7FF, Hangul among them) is not
    assert bytes([0xED, 0x9F, 0xBF]).decode() == "\ud7ff"
