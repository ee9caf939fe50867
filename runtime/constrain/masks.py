"""MaskWorkers: grammar masks filled on threads of their own, off the engine's step.

Filling a request's mask of allowed next tokens is usually microseconds, but some grammars
cost far more: `( ?[a-z]+){1,12}\\.` compiles in 0.01 s, yet every one of its masks takes
xgrammar 0.5-2 s over SmolLM2's 49k-token vocabulary (it checks most tokens against the
grammar at run time). Filled in the step, eight such requests made one step take 8 s, and every
other request in the batch waited for it. Here the fills run on worker threads (xgrammar
releases the GIL while it fills), the scheduler (scheduler/grammar_gate.py) lets a constrained
request sample only once its mask is ready, and the others go on meanwhile.

Order: the job with the earliest `queued_s + expected_s` first, where `expected_s` is how
long the state's last fill took (0 before its first). Cheap fills pass costly ones queued
before them, but a costly fill waits at most for those queued before `queued_s + expected_s`:
none waits forever. Threads start on demand and end after IDLE_EXIT_S without work.

The workers run at a lower priority (WORKER_NICENESS; Linux: a nice value per thread). On CPU
the forward's OpenMP threads wait at every region for the slowest of them, so a fill thread
that takes one of their cores slows every step (on 2 cores: median step 0.16 s at the same
priority, 0.11 s niced, 0.05 s with no fill running); niced, fills take the cores the forward
leaves idle, and still a tenth of a core's time against a busy one.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

IDLE_EXIT_S = 10.0
WORKER_NICENESS = 10  # added to a worker thread's nice value: the forward's threads go first


@dataclass
class _Job:
    state: Any  # a ConstraintState (grammar.py)
    rank_s: float  # queued at + expected seconds: the smallest runs first


class MaskWorkers:
    """Fills ConstraintStates' masks on up to `num_threads` daemon threads.

    Everything runs under one condition: `submit`, `cancel` and the waits from the engine's
    loop thread, the fills' bookkeeping from the workers (the fills themselves outside it).

    >>> workers = MaskWorkers(num_threads=1)
    >>> workers.num_pending
    0
    """

    def __init__(self, num_threads: int) -> None:
        self.num_threads = num_threads
        self._cond = threading.Condition()
        self._queued: list[_Job] = []
        self._pending: set[Any] = set()  # states queued or being filled
        self._filling: set[Any] = set()  # states being filled
        # states whose fill raised -> at which position (num_moves): the step fills them again
        self._failed: dict[Any, int] = {}
        self._num_threads_alive = 0
        self._num_idle = 0
        self.num_fills = 0  # fills done by the workers

    @property
    def num_pending(self) -> int:
        """States queued or being filled."""
        with self._cond:
            return len(self._pending)

    def is_pending(self, state: Any) -> bool:
        """Whether `state` is queued or being filled."""
        with self._cond:
            return state in self._pending

    def has_failed(self, state: Any) -> bool:
        """Whether filling `state`'s mask at its position raised (the step's fill then says
        why)."""
        with self._cond:
            return self._failed.get(state) == state.num_moves

    def submit(self, state: Any) -> None:
        """Fill `state`'s mask for its current position soon, unless it is filled, pending or
        failed."""
        with self._cond:
            if (
                state.mask_ready
                or state in self._pending
                or self._failed.get(state) == state.num_moves
            ):
                return
            self._pending.add(state)
            self._queued.append(_Job(state, time.monotonic() + (state.fill_s or 0.0)))
            if self._num_idle:
                self._cond.notify_all()  # the loop thread may be waiting on it too
            elif self._num_threads_alive < self.num_threads:
                self._num_threads_alive += 1
                threading.Thread(target=self._work, name="flowlang-masks", daemon=True).start()

    def cancel(self, state: Any) -> None:
        """Drop `state`'s fill if it has not begun (its request ended)."""
        with self._cond:
            self._failed.pop(state, None)
            for job in self._queued:
                if job.state is state:
                    self._queued.remove(job)
                    self._pending.discard(state)
                    self._cond.notify_all()
                    return

    def expects_quick_fill(self, quick_s: float) -> bool:
        """Whether a pending fill expected to be quick (its state's last fill took at most
        `quick_s`, or it never filled) is under way, or a thread is free to start one."""
        with self._cond:
            return self._expects_quick_fill(quick_s)

    def wait_quick(self, quick_s: float, deadline_s: float) -> None:
        """While `expects_quick_fill(quick_s)`, until time.monotonic() reaches `deadline_s`."""
        with self._cond:
            while self._expects_quick_fill(quick_s):
                left = deadline_s - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return

    def _expects_quick_fill(self, quick_s: float) -> bool:
        quick = [s for s in self._pending if s.fill_s is None or s.fill_s <= quick_s]
        if not quick:
            return False
        if len(self._filling) < self.num_threads:  # a thread is free (or will be started)
            return True
        return any(s in self._filling for s in quick)  # else: all busy with slow ones

    def wait_any(self, timeout_s: float) -> None:
        """Until a pending fill ends (or is cancelled), at most `timeout_s`."""
        with self._cond:
            if self._pending:
                self._cond.wait(timeout_s)

    def _work(self) -> None:
        lower_thread_priority(WORKER_NICENESS)
        while True:
            with self._cond:
                while not self._queued:
                    self._num_idle += 1
                    woken = self._cond.wait(IDLE_EXIT_S)
                    self._num_idle -= 1
                    if not woken and not self._queued:
                        self._num_threads_alive -= 1
                        return
                job = min(self._queued, key=lambda j: j.rank_s)
                self._queued.remove(job)
                self._filling.add(job.state)
            try:
                job.state.fill_mask()
                failed = False
            except Exception:  # noqa: BLE001 - the step fills it again and reports the error
                failed = True
            with self._cond:
                if failed:
                    self._failed[job.state] = job.state.num_moves
                self._pending.discard(job.state)
                self._filling.discard(job.state)
                self.num_fills += 1
                self._cond.notify_all()


def lower_thread_priority(niceness: int) -> None:
    """Lower this thread's scheduling priority by `niceness`, where the OS has per-thread nice
    values (the grammar compiles' thread lowers its own too: compile_queue.py)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness)
        )
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority, same results
        pass
