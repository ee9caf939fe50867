"""The HTTP server: SGLang's native API, the OpenAI API, and what flowlang needs (tokenize,
generate with graph hints, score, pins with leases), over one Engine.

    flowlang serve --model smollm2-135m-instruct --port 30000
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_api import EngineAPI
from runtime.server import (
    batches_api,
    dashboard,
    events_api,
    files_api,
    flowlang_api,
    openai_api,
    ops,
    sglang_api,
)
from runtime.server.drain import FAIL_GRACE_S, Drain
from runtime.server.errors import (
    AsciiJSONResponse,
    BodyReadTimeoutError,
    BodyTooLargeError,
    ShuttingDownError,
    error_response,
    install_error_handlers,
)
from runtime.server.extensions import AppExtension, install_extensions
from runtime.server.state import Server, ServerSettings
from runtime.telemetry import TraceContextMiddleware

__all__ = ["ServerSettings", "create_app", "serve"]

ADMIN_PATHS = frozenset(
    {"/flush_cache", "/start_profile", "/stop_profile", "/v1/flowlang/kv_events"}
)
PROBE_PATHS = frozenset({"/health", "/metrics"})  # answered while draining, never waited for
FOLLOWER_PATHS = frozenset({"/v1/flowlang/kv_events"})  # endless: they end when a drain begins


def create_app(
    engine: EngineAPI,
    settings: ServerSettings | None = None,
    extensions: Sequence[AppExtension] = (),
) -> FastAPI:
    """The app serving `engine`: every API, API keys, the body size limit, error mapping, and
    what `extensions` add (routes from a layer above, e.g. flowlang's programs)."""
    server = Server(engine, settings or ServerSettings())
    app = FastAPI(title="flowlang", lifespan=_lifespan, default_response_class=AsciiJSONResponse)
    app.state.server = server
    app.state.drain = Drain(server.settings.drain_timeout)
    app.state.tree_views = dashboard.TreeViews()
    # the last added runs first: the guard, the body limit, then a request's traceparent
    app.add_middleware(TraceContextMiddleware)  # (runtime/telemetry.py; off: nothing done)
    app.add_middleware(
        BodyLimit,
        limit_bytes=server.settings.max_body_bytes,
        read_timeout_s=server.settings.body_read_timeout_s,
    )
    app.add_middleware(Guard, server=server, drain=app.state.drain)
    install_error_handlers(app, server)
    for api in (
        ops,
        sglang_api,
        openai_api,
        flowlang_api,
        events_api,
        dashboard,
        files_api,
        batches_api,
    ):
        app.include_router(api.router)
    install_extensions(app, engine, extensions)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Expire pin leases and resume unfinished batches while serving; at shutdown stop the
    batches (they resume at the next start), release every pin, drain, stop the engine."""
    server: Server = app.state.server
    settings = server.settings

    async def expire_leases() -> None:
        while True:
            await asyncio.sleep(min(1.0, settings.pin_lease_seconds / 4))
            server.leases.expire()

    task = asyncio.create_task(expire_leases())
    batches_api.start_batches(app)
    yield
    task.cancel()
    await batches_api.stop_batches(app, settings.drain_timeout)
    server.leases.release_all()
    await asyncio.to_thread(server.engine.close, settings.drain_timeout)


class _HttpMiddleware:
    """ASGI middleware that acts on HTTP requests only (`http`): any other scope (the
    lifespan's startup and shutdown, a websocket) passes straight through to the app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError


class Guard(_HttpMiddleware):
    """ASGI middleware: refuse an oversized declared body (413) or a missing or wrong API key
    (401); admin routes need an admin key (403); while the server drains for shutdown, every
    new request but the probes gets a 503 with Retry-After. Requests are counted after the key
    check, by route template only (a label from the raw path would let anyone write into
    /metrics), and those the drain waits for are counted while they run.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, whose wrapped `receive` hides a
    client's disconnect from the routes (so nobody could abort its work)."""

    def __init__(self, app: ASGIApp, server: Server, drain: Drain) -> None:
        super().__init__(app)
        self.server = server
        self.drain = drain

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(Request(scope))
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        path = scope["path"]
        awaited = path not in PROBE_PATHS and path not in FOLLOWER_PATHS  # by a drain
        self.drain.in_flight += int(awaited)
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= int(awaited)
        route = scope.get("route")
        self.server.http_requests[route.path if route is not None else "unmatched"] += 1

    def _refusal(self, request: Request) -> Response | None:
        """An error response for a request that must not reach the routes; sets its tenant."""
        server = self.server
        if self.drain.draining and request.url.path not in PROBE_PATHS:
            return error_response(
                503,
                "the server is shutting down and takes no new requests; retry elsewhere",
                server,
                retry_after_s=ShuttingDownError.retry_after_s,
                headers={"Connection": "close"},
            )
        limit = server.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return error_response(
                413, f"request body of {length} bytes exceeds the limit of {limit}", server
            )
        request.state.tenant = "anonymous"
        request.state.admin = False
        path = request.url.path
        if not server.keys or path == "/health":
            return None
        browser = path == "/dashboard" or path.startswith("/dashboard/")
        key = _api_key(request.headers.get("authorization", ""), allow_basic=browser)
        if key not in server.keys:
            refusal = error_response(
                401, "missing or invalid API key (Authorization: Bearer ...)", server
            )
            if browser:  # the browser asks for the key (as the password) and sends it on
                refusal.headers["WWW-Authenticate"] = 'Basic realm="flowlang", charset="UTF-8"'
            return refusal
        if path in ADMIN_PATHS and key not in server.admin_keys:
            return error_response(403, f"{path} needs an admin key", server)
        request.state.tenant = server.keys[key]
        request.state.admin = key in server.admin_keys
        return None


def _api_key(header: str, allow_basic: bool) -> str:
    """The key in an Authorization header: a Bearer token, or (for the dashboard, which a
    browser opens) the password of HTTP Basic auth; "" if there is none."""
    scheme, _, value = header.partition(" ")
    if scheme == "Bearer":
        return value.strip()
    if scheme == "Basic" and allow_basic:
        try:
            return base64.b64decode(value.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return ""
    return ""


class BodyLimit(_HttpMiddleware):
    """ASGI middleware: a body read past `limit_bytes` fails with 413, whether or not it
    declared a Content-Length (a chunked body is counted as it arrives), and a body not whole
    within `read_timeout_s` of the route asking for it fails with 408 (a slow-loris client:
    a deadline per part would let a byte every few seconds hold the connection for days)."""

    def __init__(self, app: ASGIApp, limit_bytes: int, read_timeout_s: float) -> None:
        super().__init__(app)
        self.limit_bytes = limit_bytes
        self.read_timeout_s = read_timeout_s

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        num_bytes = 0
        body_done = False
        deadline: float | None = None  # set by the first read

        async def limited() -> Message:
            nonlocal num_bytes, body_done, deadline
            if body_done:  # afterwards receive() waits for a disconnect: no deadline
                return await receive()
            if deadline is None:
                deadline = time.monotonic() + self.read_timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise BodyReadTimeoutError(
                    f"the request body did not arrive within {self.read_timeout_s:g} s"
                ) from None
            num_bytes += len(message.get("body", b""))
            body_done = not message.get("more_body", False)
            if num_bytes > self.limit_bytes:
                raise BodyTooLargeError(
                    f"request body exceeds the limit of {self.limit_bytes} bytes"
                )
            return message

        await self.app(scope, limited, send)


def serve(
    engine_config: EngineConfig,
    settings: ServerSettings,
    sock: socket.socket | None = None,
    extensions: Sequence[AppExtension] = (),
) -> int:
    """Run the server until interrupted; then drain, release every pin, stop the engine;
    return the exit status (0 after a signal's drain).

    `sock`: the listening socket (runtime.server.listen.bind_socket), bound before the engine
    loads so that a port in use fails at once; bound here if not given. If the engine's loop
    ever dies, the process exits with status 70 so a supervisor restarts it (/health says 503
    meanwhile)."""
    from runtime.server.listen import bind_socket

    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    try:
        engine = Engine(engine_config)
    except BaseException:
        sock.close()
        raise
    threading.Thread(target=_exit_if_engine_dies, args=(engine,), daemon=True).start()
    return run_app(engine, settings, sock, extensions=extensions)


def run_app(
    engine: EngineAPI,
    settings: ServerSettings,
    sock: socket.socket | None = None,
    fatal: Callable[[], str | None] | None = None,
    fatal_grace_s: float | None = None,
    extensions: Sequence[AppExtension] = (),
) -> int:
    """Serve `engine` (or anything with its surface: runtime.cluster.front) on `sock` (bound
    to settings' host and port if not given) until SIGTERM or SIGINT; then drain
    (runtime/server/drain.py) and close it. Prints the engine's summary and the address first.

    `fatal`, asked ten times a second, names why the engine can no longer serve (else None):
    then the server drains (within `fatal_grace_s`, if given) and this returns 70, so that a
    supervisor restarts it. Returns the exit status: 0 after a signal's drain."""
    from runtime.server.listen import DrainingServer, bind_socket, uvicorn_config

    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    app = create_app(engine, settings, extensions)
    config = uvicorn_config(
        app,
        settings,
        log_level="info",
        # the drain has already waited for (or failed) every request by then
        timeout_graceful_shutdown=int(FAIL_GRACE_S) + 5,
        timeout_keep_alive=5,
    )
    host, port = settings.host, sock.getsockname()[1]  # port 0 asked for any free one
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    print(engine.summary().render(), file=sys.stderr)
    print(f"[flowlang] serving on {url}; live page: {url}/dashboard", file=sys.stderr, flush=True)
    drain: Drain = app.state.drain
    DrainingServer(config, drain, fatal, fatal_grace_s).run(sockets=[sock])
    if drain.reason is not None:
        print(f"[flowlang] stopped ({drain.reason})", file=sys.stderr, flush=True)
    return drain.exit_status


def _exit_if_engine_dies(engine: EngineAPI) -> None:
    while engine.is_alive or engine.closed:
        if engine.closed:
            return
        time.sleep(1.0)
    print(f"[flowlang] the engine died ({engine.fatal_error}); exiting", file=sys.stderr)
    os._exit(70)
