"""The server's connections: uvicorn's h11 protocol with a deadline on each request head.

ASGI middleware only sees a request once its head (request line and headers) is complete, so a
client that dribbles its headers a byte at a time (slow loris) would hold its connection
forever: uvicorn's keep-alive timer stops at the first byte and never restarts before the head
is whole. Here a connection whose request head is not complete within `head_timeout_s` of the
connection opening (or of the previous response) gets a 408 and is closed.

`DrainingServer` is uvicorn's server with a drain before its shutdown (runtime/server/drain.py):
the listening socket stays open while requests finish, so that a new request gets a 503 instead
of a refused connection, and a signal ends the process with status 0.

The listening socket is bound (`bind_socket`) before the engine loads, and uvicorn serves on
that socket: a port in use is reported at once, and nothing can take the port between a check
and the bind. This module imports no torch, so `flowlang serve` binds within a second.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.errors import UsageError

if TYPE_CHECKING:
    from runtime.server.drain import Drain
    from runtime.server.state import ServerSettings

BACKLOG = 2048  # uvicorn's default; it listens again with its own when it starts serving
EXIT_ENGINE_LOST = 70  # EX_SOFTWARE, as when the engine's loop dies: a supervisor restarts it


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request head comes too slowly."""

    def __init__(self, *args: Any, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_head_deadline()  # the head is complete: the body has its own timeout

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_deadline()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_slow)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        """408 in our error shape, written raw: h11 has no request to answer yet."""
        self._head_deadline = None
        if self.transport.is_closing():
            return
        message = f"the request head did not arrive within {self.head_timeout_s:g} s"
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "code": 408}}
        ).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining before it shuts down: the first SIGTERM or SIGINT (or
    `fatal()` naming why the engine cannot serve) begins the app's Drain, and uvicorn's own
    shutdown (listener closed, connections closed, the app's lifespan end) runs once the drain
    is over; after `fatal()`, within `fatal_grace_s`. A second signal stops at once.

    uvicorn re-raises a signal it stopped for, so the process would die of it (status 143);
    a drained server has done what the signal asked, and its process ends with the drain's
    exit status instead."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        fatal: Callable[[], str | None] | None = None,
        fatal_grace_s: float | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self.fatal = fatal
        self.fatal_grace_s = fatal_grace_s
        self._signal: int | None = None  # recorded by the handler, acted on by the loop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._signal is None:
            self._signal = sig
            return
        super().handle_exit(sig, frame)  # the second: uvicorn stops now, and dies of it
        self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        drain, now = self.drain, time.monotonic()
        if not drain.draining:
            if self._signal is not None:
                drain.begin(signal.Signals(self._signal).name, now)
            elif self.fatal is not None and (reason := self.fatal()) is not None:
                drain.begin(reason, now, EXIT_ENGINE_LOST, self.fatal_grace_s)
        if drain.tick(now):
            return True
        return await super().on_tick(counter)


def uvicorn_config(app: Any, settings: ServerSettings, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for `app` (an ASGI app, maybe wrapping create_app's) under
    `settings`, its connections on HeadDeadlineProtocol."""
    protocol = functools.partial(HeadDeadlineProtocol, head_timeout_s=settings.head_timeout_s)
    return uvicorn.Config(app, host=settings.host, port=settings.port, http=protocol, **options)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` and listening (port 0: any free one), for
    `uvicorn.Server.run(sockets=[...])`; a UsageError when the address cannot be had.

    It listens at once, not when uvicorn starts: a bound socket that does not listen does not
    hold the port against another SO_REUSEADDR binder (a second `flowlang serve` would load
    its model too, then fail), and clients that connect while the model loads wait in the
    backlog instead of being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart skips TIME_WAIT
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise UsageError(
                f"port {port} on {host} is already in use (by another server, perhaps another "
                f"flowlang serve); choose another with --port"
            ) from err
        why = err.strerror or str(err)
        raise UsageError(
            f"cannot listen on {host} port {port} ({why}); check --host and --port"
        ) from err
    return sock
