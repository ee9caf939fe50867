"""The graph hints flowlang sends for eviction: a request is a continuation exactly when the same
state has another request queued behind it (its next turn), not when only text (a role's end)
is left."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from flowlang import assistant, gen, program, user
from flowlang.backends.mock import MockBackend


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
