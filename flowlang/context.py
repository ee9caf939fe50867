"""RunContext: what every state of one program run shares (backend, pins, the first failure)."""

from __future__ import annotations

import contextvars
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowlang.backends.base import Backend, PinLease
from flowlang.errors import ExecutionError
from runtime.protocol import SamplingParams
from runtime.telemetry import NULL_SPAN

if TYPE_CHECKING:
    from flowlang.executor import StreamExecutor


@dataclass
class RunContext:
    """Shared by every state of one program run."""

    backend: Backend
    namespace: str | None = None
    program_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    priority: int = 0
    sampling: SamplingParams | None = None  # run-level defaults: the fields a gen does not set
    pins: list[PinLease] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fork_count: int = 0
    executors: list[StreamExecutor] = field(default_factory=list)
    error: BaseException | None = None
    # the run's span (flowlang/telemetry.py): current while the body runs, the parent of the
    # root state's steps; NULL_SPAN with tracing off
    span: Any = NULL_SPAN

    def next_fork_id(self) -> str:
        """A fork id unique in this run."""
        with self.lock:
            self.fork_count += 1
            return f"{self.program_id}-f{self.fork_count}"

    def fail(self, err: BaseException) -> None:
        """The first failure stops the whole run: every state drains and wakes its readers."""
        with self.lock:
            if self.error is None:
                self.error = err
            executors = list(self.executors)
        for executor in executors:
            executor.wake_all()

    def sync_all(self) -> None:
        """Wait for every state of the run; raise the first failure."""
        first: BaseException | None = None
        index = 0
        while index < len(self.executors):  # by index: branches forked meanwhile are waited for
            executor = self.executors[index]
            try:
                executor.sync()
            except ExecutionError as err:
                first = first or err
            index += 1
        if first is not None:
            raise first

    def close_all(self) -> None:
        """Stop every state's worker and release the pins still held."""
        for executor in list(self.executors):
            executor.close()
        with self.lock:
            pins, self.pins = self.pins, []
        for pin in pins:
            pin.release()


# the run whose body is executing on this thread: a program called from inside another's body
# runs on that run's backend and namespace (as SGLang's nested calls do)
_CURRENT_RUN: contextvars.ContextVar[RunContext | None] = contextvars.ContextVar(
    "flowlang_current_run", default=None
)


def current_run() -> RunContext | None:
    """The RunContext whose program body is running on this thread, if any."""
    return _CURRENT_RUN.get()


def body_of(ctx: RunContext) -> contextvars.Token:
    """Mark `ctx` as the run whose body runs on this thread (undo with `_CURRENT_RUN.reset`)."""
    return _CURRENT_RUN.set(ctx)


def body_ended(token: contextvars.Token) -> None:
    """The body marked by `body_of` returned."""
    _CURRENT_RUN.reset(token)
