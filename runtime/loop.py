"""The engine's loop thread: commands from any thread, run between steps on one thread.

Every call into the engine becomes a command on a queue; the loop drains the queue, then runs
one step while there is work. So the scheduler, the tree and the KV pool are touched by one
thread only, and nothing a caller sends can stop that thread: a failing command or step is
reported and the loop goes on.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

# with work that cannot run now, the loop looks again after this, or at the next command (a
# request back from its tool, an abort) if that comes sooner
IDLE_POLL_S = 0.001


class EngineLoop:
    """Runs `step()` while `has_work()`, and commands in between, on a daemon thread."""

    def __init__(
        self,
        step: Callable[[], bool],
        has_work: Callable[[], bool],
        on_step_error: Callable[[str], None],
    ) -> None:
        self._step = step
        self._has_work = has_work
        self._on_step_error = on_step_error  # fails what the step was running
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self.fatal_error: str | None = None  # why the thread died, if it ever does
        self._thread = threading.Thread(target=self._run, name="flowlang-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    def post(self, command: Callable[[], None]) -> None:
        """Run `command` on the loop thread, soon; returns at once."""
        self._commands.put(command)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread and return its result (or raise its exception)."""
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as err:  # noqa: BLE001 - handed to the caller
                done.set_exception(err)

        self.post(run)
        return done.result()

    def stop(self, last_command: Callable[[], None]) -> None:
        """Run `last_command`, then end the thread and wait for it."""
        self._commands.put(last_command)
        self._stop.set()
        self._commands.put(lambda: None)  # wakes a loop blocked on an empty queue
        self._thread.join()

    def _run(self) -> None:
        try:
            while self._once():
                pass
        except BaseException as err:  # the thread is dying: say so where health checks look
            self.fatal_error = f"{type(err).__name__}: {err}"
            log_failure("the engine loop died")
            raise

    def _once(self) -> bool:
        """Pending commands, then one step; False once stopped."""
        # (once stopping, never block: the idle wait below may have taken stop's wake-up)
        self._drain(block=not self._has_work() and not self._stop.is_set())
        if self._stop.is_set() and self._commands.empty():
            return False
        if not self._has_work():
            return True
        try:
            progressed = self._step()
        except Exception:  # noqa: BLE001 - a failed step fails its requests, not the engine
            self._on_step_error(f"engine step failed: {log_failure('engine step failed')}")
            progressed = True
        if not progressed:  # work waits (for memory, a return): the next command, or 1 ms
            self._drain(block=True, timeout_s=IDLE_POLL_S)
        return True

    def _drain(self, block: bool, timeout_s: float | None = None) -> None:
        try:
            command = self._commands.get(block=block, timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            try:
                command()
            except Exception:  # noqa: BLE001 - one caller's bad command never stops the loop
                log_failure("an engine command failed")
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return


def log_failure(what: str) -> str:
    """Print the current exception's traceback to stderr; return its last line."""
    message = traceback.format_exc(limit=8)
    print(f"[flowlang] {what}:\n{message}", file=sys.stderr)
    return message.strip().splitlines()[-1]
