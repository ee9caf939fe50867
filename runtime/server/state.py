"""What every route shares: the server's settings and state (engine, pin leases, counters,
tenants), and the FastAPI dependency that hands it to a route."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from runtime.engine import Engine
from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult
from runtime.server.pins import PinLeases
from runtime.server.streaming import abort_unfinished, wait_results


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 30000
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()  # also valid API keys; only these may flush the cache
    max_body_bytes: int = 8 << 20
    pin_lease_seconds: float = 30.0
    drain_timeout: float = 10.0


class Server:
    """Shared state of the routes: the engine, leases, counters, auth."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.leases = PinLeases(engine, settings.pin_lease_seconds)
        self.http_requests: Counter[str] = Counter()
        self.http_errors: Counter[int] = Counter()
        self.started = time.time()
        keys = (*settings.api_keys, *settings.admin_keys)
        self.keys = {k: "k" + hashlib.sha256(k.encode()).hexdigest()[:8] for k in keys}
        self.admin_keys = frozenset(settings.admin_keys)

    def tenant(self, request: Request) -> str:
        """Who is calling: the API key's tag, or "anonymous" without keys."""
        return request.state.tenant

    def namespace(self, request: Request, requested: str | None) -> str | None:
        """Cache salt: per API key, so tenants never share entries; plus the request's own."""
        tenant = self.tenant(request) if self.keys else None
        parts = [p for p in (tenant, requested) if p]
        return "/".join(parts) or None

    async def submit(self, requests: list[GenerateRequest]) -> list[RequestHandle]:
        """Submit all of `requests` (streaming to this event loop), or none of them.

        Tokenizing and grammar compilation happen in a worker thread: a huge prompt or a
        pathological grammar never stalls the event loop (/health included)."""
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self._submit_all, requests, loop)

    def _submit_all(
        self, requests: list[GenerateRequest], loop: asyncio.AbstractEventLoop
    ) -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        try:
            for request in requests:
                handles.append(self.engine.submit(request, loop=loop))
        except Exception:
            # the client gets an error for the whole call: nobody would read the others
            abort_unfinished(self.engine, handles)
            raise
        return handles

    async def wait(self, request: Request, handles: list[RequestHandle]) -> list[GenerateResult]:
        """Results of `handles`, aborting them if the client goes away meanwhile."""
        return await wait_results(request, self.engine, handles)


def get_server(request: Request) -> Server:
    """The app's shared Server (a FastAPI dependency)."""
    return request.app.state.server


ServerDep = Annotated[Server, Depends(get_server)]
