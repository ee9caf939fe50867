"""What every route shares: the server state (engine, pin leases, counters, tenants), SSE
framing and error bodies."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from runtime.engine import Engine, RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult
from runtime.server.pins import PinLeases


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 8 << 20
    pin_lease_seconds: float = 30.0
    drain_timeout: float = 10.0


class ClientGone(Exception):
    """The client disconnected before its result was ready (the request was aborted)."""


class Server:
    """Shared state of the routes: the engine, leases, counters, auth."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.leases = PinLeases(engine, settings.pin_lease_seconds)
        self.http_requests: Counter[str] = Counter()
        self.http_errors: Counter[int] = Counter()
        self.started = time.time()
        self.keys = {k: "k" + hashlib.sha256(k.encode()).hexdigest()[:8] for k in settings.api_keys}

    def tenant(self, request: Request) -> str:
        """Who is calling: the API key's tag, or "anonymous" without keys."""
        return request.state.tenant

    def namespace(self, request: Request, requested: str | None) -> str | None:
        """Cache salt: per API key, so tenants never share entries; plus the request's own."""
        tenant = self.tenant(request) if self.keys else None
        parts = [p for p in (tenant, requested) if p]
        return "/".join(parts) or None

    async def wait(self, request: Request, handles: list[RequestHandle]) -> list[GenerateResult]:
        """Results of `handles`, aborting them if the client goes away meanwhile."""
        waiter = asyncio.gather(*(h.aresult() for h in handles))
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=0.25)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                for handle in handles:
                    self.engine.abort(handle.rid)
                await asyncio.gather(waiter, return_exceptions=True)
                raise ClientGone()

    def submit(self, request: GenerateRequest) -> RequestHandle:
        return self.engine.submit(request, loop=asyncio.get_running_loop())


def sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def frames() -> AsyncIterator[bytes]:
        async for chunk in chunks:
            yield f"data: {chunk}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


def error_response(status: int, message: str, server: Server) -> JSONResponse:
    server.http_errors[status] += 1
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )
