"""EngineLoop (runtime/loop.py): work that cannot run waits for the next command or a poll, and
stopping never hangs, whatever the last step did."""

from __future__ import annotations

import threading
import time

import runtime.loop as loop_module
from runtime.loop import EngineLoop


def test_stop_returns_when_its_last_command_ends_work_that_could_not_run():
    """The loop's idle wait (work that cannot run) takes commands off the queue: stop's last
    command (Engine.close fails what is left, so no work remains) and its wake-up. The loop
    must not then block on the empty queue."""
    work = [True]
    steps = []

    def step() -> bool:
        steps.append(time.monotonic())
        return False  # nothing could run: the loop waits for a command or a poll

    loop = EngineLoop(step, lambda: work[0], lambda message: None)
    while len(steps) < 5:
        time.sleep(0.001)
    stopper = threading.Thread(
        target=loop.stop, args=(lambda: work.__setitem__(0, False),), daemon=True
    )
    stopper.start()
    stopper.join(timeout=5.0)
    assert not stopper.is_alive(), "stop hung"


def test_a_command_wakes_a_loop_whose_work_cannot_run(monkeypatch):
    """Work that cannot run waits for the next command (a request back from its tool), not a
    fixed sleep: with the poll stretched to a minute, a posted command still runs at once."""
    monkeypatch.setattr(loop_module, "IDLE_POLL_S", 60.0)
    ran = threading.Event()
    loop = EngineLoop(lambda: False, lambda: True, lambda message: None)
    loop.post(ran.set)
    assert ran.wait(timeout=5.0)
    loop.stop(lambda: None)
