"""The graph hints flowlang sends for eviction: a request is a continuation exactly when the same
state has another request queued behind it (its next turn), not when only text (a role's end)
is left."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from flowlang import assistant, gen, program, user
from flowlang.backends.mock import MockBackend
from flowlang.errors import ProgramError


@dataclass
class GatedBackend(MockBackend):
    """Renders nothing until the program body has appended all its nodes, so the hints see the
    whole program, as they do whenever the body runs ahead of the engine."""

    body_done: threading.Event = field(default_factory=threading.Event)

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert self.body_done.wait(timeout=10), "the program body never finished"
        return super().tokenize(text, add_special_tokens)


@program
def chat(s, messages, body_done):
    for turn, message in enumerate(messages):
        s += user(message)
        s += assistant(gen(f"reply_{turn}", max_new_tokens=4))
    body_done.set()


@program
def one_question(s, body_done):
    s += "Q: why?\nA:"
    s += gen("answer", max_new_tokens=4)
    s += "\nThanks."
    body_done.set()


def test_every_turn_but_the_last_is_a_continuation():
    backend = GatedBackend()
    chat.run(["hello", "and then?", "bye"], backend.body_done, backend=backend)
    assert [r.hints.continuation for r in backend.requests] == [True, True, False]


def test_a_gen_followed_by_text_only_is_no_continuation():
    backend = GatedBackend()
    one_question.run(backend.body_done, backend=backend)
    assert [r.hints.continuation for r in backend.requests] == [False]


@program
def agent(s, body_done):
    s += user("Look the order up.")
    s += assistant(gen("plan", max_new_tokens=4, next_turn_after_s=2.5))  # a tool call next
    s += user("The tool says: shipped.")
    s += assistant(gen("answer", max_new_tokens=4, next_turn_after_s=9.0))  # nothing follows
    body_done.set()


def test_a_gen_declares_when_its_state_comes_back_only_while_work_remains():
    backend = GatedBackend()
    agent.run(backend.body_done, backend=backend)
    assert [r.hints.next_turn_after_s for r in backend.requests] == [2.5, None]
    assert [r.hints.continuation for r in backend.requests] == [True, False]


def test_a_negative_declared_delay_is_refused_by_name():
    with pytest.raises(ProgramError, match="next_turn_after_s"):
        gen("x", next_turn_after_s=-1)
