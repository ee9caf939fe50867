"""Shutting down without losing an accepted request.

A drain begins on SIGTERM or SIGINT (runtime/server/listen.py), or when the engine can no
longer serve (a cluster that lost Ray's control store). While it drains, new requests get a
503 with Retry-After, /health says "draining", and requests already running go on. Once they
have all finished, or `grace_s` has passed, the server stops; requests still running at the
grace period's end are failed first, each with a JSON 503 or a terminal SSE error frame, so that
no client sees a cut connection.

State changes happen on the event loop (the signal handler only records the signal), so the
middleware, the routes and uvicorn's tick read it without a lock.
"""

from __future__ import annotations

import asyncio

FAIL_GRACE_S = 5.0  # after the grace period: time for failed requests to send their 503s


class Drain:
    """The server's shutdown state: serving, draining, expired (failing what is left), over.

    >>> drain = Drain(grace_s=10.0)
    >>> drain.begin("SIGTERM", now=100.0)
    >>> drain.in_flight = 1
    >>> drain.tick(now=105.0), drain.expired
    (False, False)
    >>> drain.tick(now=110.0), drain.expired
    (False, True)
    >>> drain.in_flight = 0
    >>> drain.tick(now=110.1)
    True
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.in_flight = 0  # requests the drain waits for (not probes, not event followers)
        self.reason: str | None = None  # why it drains (a signal, the engine lost)
        self.exit_status = 0  # what `flowlang serve` exits with once it is over
        self.expired = False  # the grace period is over: requests still running are failed
        self._began_s: float | None = None
        self._expired_event: asyncio.Event | None = None

    @property
    def draining(self) -> bool:
        """Whether new requests are refused."""
        return self.reason is not None

    def begin(
        self, reason: str, now: float, exit_status: int = 0, max_grace_s: float | None = None
    ) -> None:
        """Stop taking requests (the first reason wins); `now` in time.monotonic() seconds;
        `max_grace_s` shortens the grace period (the process has only so long left)."""
        if self.reason is None:
            self.reason, self.exit_status, self._began_s = reason, exit_status, now
            if max_grace_s is not None:
                self.grace_s = min(self.grace_s, max_grace_s)

    def tick(self, now: float) -> bool:
        """Advance the drain at `now`; True once the server may stop (nothing left running,
        or the failed requests had FAIL_GRACE_S to answer)."""
        if self._began_s is None:
            return False
        if self.in_flight == 0:
            return True
        if not self.expired and now >= self._began_s + self.grace_s:
            self.expired = True
            if self._expired_event is not None:
                self._expired_event.set()
        return self.expired and now >= self._began_s + self.grace_s + FAIL_GRACE_S

    async def wait_expired(self) -> None:
        """Return when the grace period is over (on the event loop)."""
        if self._expired_event is None:
            self._expired_event = asyncio.Event()
            if self.expired:
                self._expired_event.set()
        await self._expired_event.wait()
