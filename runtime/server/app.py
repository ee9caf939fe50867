"""The HTTP server: SGLang's native API, the OpenAI API, and what flowlang needs (tokenize,
generate with graph hints, score, pins with leases), over one Engine.

    flowlang serve --model smollm2-135m-instruct --port 30000
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request, Response

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.server import flowlang_api, openai_api, ops, sglang_api
from runtime.server.errors import error_response, install_error_handlers
from runtime.server.state import Server, ServerSettings

__all__ = ["ServerSettings", "create_app", "serve"]


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    """The app serving `engine`: every API, API keys, the body size limit, error mapping."""
    server = Server(engine, settings or ServerSettings())
    app = FastAPI(title="flowlang", lifespan=_lifespan)
    app.state.server = server
    app.middleware("http")(_guard)
    install_error_handlers(app, server)
    for api in (ops, sglang_api, openai_api, flowlang_api):
        app.include_router(api.router)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Expire pin leases while serving; at shutdown release every pin, drain, stop the engine."""
    server: Server = app.state.server
    settings = server.settings

    async def expire_leases() -> None:
        while True:
            await asyncio.sleep(min(1.0, settings.pin_lease_seconds / 4))
            server.leases.expire()

    task = asyncio.create_task(expire_leases())
    yield
    task.cancel()
    server.leases.release_all()
    await asyncio.to_thread(server.engine.close, settings.drain_timeout)


async def _guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """Count every request; refuse an oversized body (413) or a missing or wrong API key (401)."""
    server: Server = request.app.state.server
    server.http_requests[request.url.path] += 1
    limit = server.settings.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and int(length) > limit:
        return error_response(
            413, f"request body of {length} bytes exceeds the limit of {limit}", server
        )
    request.state.tenant = "anonymous"
    if server.keys and request.url.path != "/health":
        header = request.headers.get("authorization", "")
        key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
        if key not in server.keys:
            return error_response(
                401, "missing or invalid API key (Authorization: Bearer ...)", server
            )
        request.state.tenant = server.keys[key]
    return await call_next(request)


def serve(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Run the server until interrupted; then drain, release every pin, stop the engine."""
    import uvicorn

    engine = Engine(engine_config)
    app = create_app(engine, settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.drain_timeout) + 5,
    )
