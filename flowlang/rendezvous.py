"""Rendezvous: where a state's readers wait for the variables its worker defines.

The program thread runs ahead of the worker, so a read may come before, during or after the
node that defines the variable; a failed run must wake every reader instead of stranding it.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from flowlang.errors import ExecutionError, FlowlangError

END = object()  # the end of a gen's text deltas (see `deltas`)


class Rendezvous:
    """Variables by name: `promise` a definition, `publish` it, `wait` for it; `fail` wakes all.

    A name may be defined again (an agent's gen("step") each round): a read waits for the last
    definition promised before it, not an earlier value.

    >>> r = Rendezvous()
    >>> r.promise("x"); r.publish("x", 1, {}); r.wait("x")
    1
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.metadata: dict[str, dict[str, Any]] = {}
        # one Event per name, made under the lock: the reader and the worker may ask for the
        # same name at once, and two Events for one name would strand the reader
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}
        self._streams: dict[str, queue.Queue] = {}
        self._num_promised: dict[str, int] = {}
        self._num_published: dict[str, int] = {}
        self._failed = False  # after `fail`, new Events start set and new streams ended
        self._cause: BaseException | None = None

    def promise(self, name: str) -> None:
        """A definition of `name` is coming: reads wait for it (and not an earlier value)."""
        with self._lock:
            self._num_promised[name] = self._num_promised.get(name, 0) + 1
            if not self._failed:
                self._event(name).clear()

    def publish(self, name: str, value: Any, meta: dict[str, Any]) -> None:
        """Define `name`; readers wake once every promised definition is published."""
        with self._lock:
            self.values[name] = value
            self.metadata[name] = meta
            self._num_published[name] = self._num_published.get(name, 0) + 1
            if self._num_published[name] >= self._num_promised.get(name, 0):
                self._event(name).set()

    def wait(self, name: str) -> Any:
        """The value of `name` once its last promised definition is published; raises the
        run's failure (as an ExecutionError unless it is a flowlang error) if woken by one."""
        with self._lock:
            event = self._event(name)
        event.wait()
        with self._lock:
            pending = self._num_published.get(name, 0) < self._num_promised.get(name, 0)
            cause = self._cause
        if name not in self.values or pending:  # woken by a failure, not by its value
            if isinstance(cause, FlowlangError):
                raise cause
            raise ExecutionError(f"{name!r} was not produced: {cause!r}") from cause
        return self.values[name]

    def deltas(self, name: str) -> queue.Queue:
        """The queue of `name`'s text deltas as they are generated, ended by END."""
        with self._lock:
            if name not in self._streams:
                self._streams[name] = queue.Queue()
                if self._failed:  # nothing will stream here
                    self._streams[name].put(END)
            return self._streams[name]

    def fail(self, cause: BaseException | None) -> None:
        """The run failed with `cause`: wake every reader, now and later, and end every stream.
        Called again (the state's own node failed after another's), the later cause holds."""
        with self._lock:
            self._failed = True
            self._cause = cause
            events = list(self._events.values())
            streams = list(self._streams.values())
        for event in events:
            event.set()
        for deltas in streams:
            deltas.put(END)

    def _event(self, name: str) -> threading.Event:
        """`name`'s Event (the lock held)."""
        event = self._events.get(name)
        if event is None:
            event = self._events[name] = threading.Event()
            if self._failed:
                event.set()
        return event
