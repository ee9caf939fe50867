"""Rendezvous on its own: a read before or after the definition, a redefinition, a failure."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from flowlang.errors import ExecutionError, ProgramError
from flowlang.rendezvous import END, Rendezvous

WAIT_S = 30  # a deadline only: every wait below is on a condition


def test_publish_before_wait_returns_at_once():
    r = Rendezvous()
    r.promise("x")
    r.publish("x", 42, {"tokens": 1})
    assert r.wait("x") == 42
    assert r.metadata["x"] == {"tokens": 1}


def test_wait_before_publish_from_another_thread():
    r = Rendezvous()
    r.promise("x")
    waiting = threading.Event()

    def read():
        waiting.set()
        return r.wait("x")

    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(read)
        assert waiting.wait(WAIT_S)
        assert not reader.done()  # nothing published: the reader waits
        r.publish("x", "value", {})
        assert reader.result(timeout=WAIT_S) == "value"


def test_a_read_waits_for_the_last_promised_definition():
    r = Rendezvous()
    r.promise("step")
    r.publish("step", 1, {})
    r.promise("step")  # a second round will define it again
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(r.wait, "step")
        assert not reader.done()
        r.publish("step", 2, {})
        assert reader.result(timeout=WAIT_S) == 2


def test_failure_propagates_to_readers_waiting_and_later():
    r = Rendezvous()
    r.promise("x")
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(r.wait, "x")
        r.fail(RuntimeError("engine gone"))
        with pytest.raises(ExecutionError, match="'x' was not produced") as caught:
            reader.result(timeout=WAIT_S)
    assert isinstance(caught.value.__cause__, RuntimeError)
    r.promise("y")  # promised after the failure: never waits
    with pytest.raises(ExecutionError, match="engine gone"):
        r.wait("y")


def test_a_flowlang_failure_is_raised_as_it_is_and_a_published_value_stays_readable():
    r = Rendezvous()
    r.promise("done")
    r.publish("done", "yes", {})
    r.promise("x")
    cause = ProgramError("gen('x') needs a prompt")
    r.fail(cause)
    with pytest.raises(ProgramError) as caught:
        r.wait("x")
    assert caught.value is cause
    assert r.wait("done") == "yes"


def test_deltas_end_on_failure_and_start_ended_after_it():
    r = Rendezvous()
    live = r.deltas("x")
    live.put("Hel")
    r.fail(RuntimeError("stop"))
    assert [live.get(timeout=WAIT_S), live.get(timeout=WAIT_S)] == ["Hel", END]
    assert r.deltas("x") is live
    assert r.deltas("late").get(timeout=WAIT_S) is END
