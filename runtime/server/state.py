"""What every route shares: the server's settings and state (engine, pin leases, counters,
tenants), and the FastAPI dependency that hands it to a route."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult
from runtime.server.errors import TooManyRequestsError
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
    max_requests_per_key: int = 512  # in flight at once, per API key (429 beyond)
    max_pinned_tokens_per_key: int | None = None  # default: half the KV pool (429 beyond)
    body_read_timeout_s: float = 30.0  # a body that trickles in slower than this is a 408
    head_timeout_s: float = 10.0  # a request line + headers not whole by then: 408, closed
    request_timeout_s: float | None = None  # for requests that set no timeout_s (then a 408)


class Server:
    """Shared state of the routes: the engine, leases, counters, auth."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        pool = engine.stats()["kv_slots_total"]
        self.leases = PinLeases(
            engine, settings.pin_lease_seconds, settings.max_pinned_tokens_per_key or pool // 2
        )
        self.inflight: Counter[str] = Counter()  # requests in flight per tenant
        self._inflight_lock = threading.Lock()
        self.http_requests: Counter[str] = Counter()
        self.http_errors: Counter[int] = Counter()
        self.started = time.time()
        keys = (*settings.api_keys, *settings.admin_keys)
        self.keys = {k: "k" + hashlib.sha256(k.encode()).hexdigest()[:8] for k in keys}
        self.admin_keys = frozenset(settings.admin_keys)

    def tenant(self, request: Request) -> str:
        """Who is calling: the API key's tag, or "anonymous" without keys."""
        return request.state.tenant

    def is_admin(self, request: Request) -> bool:
        """Whether the caller's API key is an admin key."""
        return request.state.admin

    def namespace(self, request: Request, requested: str | None) -> str | None:
        """Cache salt: per API key, so tenants never share entries; plus the request's own."""
        tenant = self.tenant(request) if self.keys else None
        parts = [p for p in (tenant, requested) if p]
        return "/".join(parts) or None

    async def submit(self, requests: list[GenerateRequest], tenant: str) -> list[RequestHandle]:
        """Submit all of `requests` (streaming to this event loop), or none of them; a tenant
        over its limit of requests in flight gets a TooManyRequestsError (429).

        Tokenizing and grammar compilation happen in a worker thread: a huge prompt or a
        pathological grammar never stalls the event loop (/health included)."""
        self._reserve(tenant, len(requests))
        default = self.settings.request_timeout_s
        if default is not None:
            requests = [
                r if r.timeout_s else r.model_copy(update={"timeout_s": default}) for r in requests
            ]
        loop = asyncio.get_running_loop()
        try:
            handles = await asyncio.to_thread(self._submit_all, requests, loop)
        except BaseException:
            self._release(tenant, len(requests))
            raise
        for handle in handles:
            handle.future.add_done_callback(lambda _: self._release(tenant, 1))
        return handles

    def _reserve(self, tenant: str, num_requests: int) -> None:
        limit = self.settings.max_requests_per_key
        if num_requests > limit:
            raise InvalidRequestError(f"a batch of {num_requests} exceeds the limit of {limit}")
        with self._inflight_lock:
            if self.inflight[tenant] + num_requests > limit:
                raise TooManyRequestsError(
                    f"this API key has {self.inflight[tenant]} requests in flight "
                    f"(limit {limit}); retry when some finish"
                )
            self.inflight[tenant] += num_requests

    def _release(self, tenant: str, num_requests: int) -> None:
        with self._inflight_lock:
            self.inflight[tenant] -= num_requests

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
