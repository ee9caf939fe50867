"""What every route shares: the server's settings and state (engine, pin leases, counters,
tenants), and the FastAPI dependency that hands it to a route."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from runtime.engine_api import EngineAPI
from runtime.errors import InvalidRequestError, UnknownRequestError
from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult, StreamChunk
from runtime.server.compiles import compile_ahead
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
    max_kv_followers_per_key: int = 16  # open /v1/flowlang/kv_events streams (429 beyond)
    batch_dir: str | None = None  # Batch API files and batches; default: <cache dir>/batches


class Server:
    """Shared state of the routes: the engine, leases, counters, auth."""

    def __init__(self, engine: EngineAPI, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        pool = engine.stats()["kv_slots_total"]
        self.leases = PinLeases(
            engine, settings.pin_lease_seconds, settings.max_pinned_tokens_per_key or pool // 2
        )
        self.inflight: Counter[str] = Counter()  # requests in flight per tenant
        self._inflight_lock = threading.Lock()  # guards inflight, _requests, _kv_followers
        self._requests: dict[tuple[str, str], TenantHandle] = {}  # by (tenant, client's id)
        self._kv_followers: Counter[str] = Counter()  # open KV event streams per tenant
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

    async def submit(self, requests: list[GenerateRequest], tenant: str) -> list[TenantHandle]:
        """Submit all of `requests` (streaming to this event loop), or none of them; a tenant
        over its limit of requests in flight gets a TooManyRequestsError (429).

        Request ids are per tenant: with API keys the engine's id is the client's qualified
        by the tenant's tag, and the handles answer under the client's own id. An id the
        tenant already has in flight is an InvalidRequestError (400); another tenant's is not.

        Tokenizing and grammar compilation happen in a worker thread: a huge prompt or a
        pathological grammar never stalls the event loop (/health included)."""
        handles = self._reserve(tenant, [r.rid for r in requests])
        default_timeout_s = self.settings.request_timeout_s
        engine_requests = [
            r.model_copy(
                update={"rid": h.engine_rid, "timeout_s": r.timeout_s or default_timeout_s}
            )
            for r, h in zip(requests, handles, strict=True)
        ]
        loop = asyncio.get_running_loop()
        try:
            await compile_ahead(self.engine, engine_requests, tenant)  # holds no thread meanwhile
            engine_handles = await asyncio.to_thread(self._submit_all, engine_requests, loop)
        except BaseException:
            self._release(tenant, handles)
            raise
        for handle, engine_handle in zip(handles, engine_handles, strict=True):
            handle.future.add_done_callback(lambda _, h=handle: self._release(tenant, [h]))
            handle.attach(engine_handle)
        return handles

    def abort(self, tenant: str, rid: str) -> None:
        """Abort `tenant`'s request `rid`. An id it has not in flight is an UnknownRequestError
        (404) whether or not another tenant uses it: ids never cross tenants."""
        with self._inflight_lock:
            handle = self._requests.get((tenant, rid))
        if handle is None:
            raise UnknownRequestError(f"no request {rid!r} in flight")
        handle.cancel()

    def abort_all(self, tenant: str) -> list[str]:
        """Abort every request `tenant` has in flight; returns their ids."""
        with self._inflight_lock:
            handles = [h for (owner, _), h in self._requests.items() if owner == tenant]
        for handle in handles:
            handle.cancel()
        return [h.rid for h in handles]

    def _reserve(self, tenant: str, rids: list[str]) -> list[TenantHandle]:
        """Count `rids` against the tenant's limit and register them (unfinished handles)."""
        limit = self.settings.max_requests_per_key
        if len(rids) > limit:
            raise InvalidRequestError(f"a batch of {len(rids)} exceeds the limit of {limit}")
        if len(set(rids)) != len(rids):
            raise InvalidRequestError("a batch gives one request id to several requests")
        handles = [TenantHandle(rid, f"{tenant}/{rid}" if self.keys else rid) for rid in rids]
        with self._inflight_lock:
            _refuse_past_limit(self.inflight[tenant], len(rids), limit, _IN_FLIGHT)
            for rid in rids:
                if (tenant, rid) in self._requests:
                    raise InvalidRequestError(f"request id {rid!r} is already in flight")
            self.inflight[tenant] += len(rids)
            self._requests.update({(tenant, h.rid): h for h in handles})
        return handles

    def _release(self, tenant: str, handles: list[TenantHandle]) -> None:
        with self._inflight_lock:
            self.inflight[tenant] -= len(handles)
            for handle in handles:
                if self._requests.get((tenant, handle.rid)) is handle:
                    del self._requests[tenant, handle.rid]

    def reserve_work(self, tenant: str, num_requests: int) -> None:
        """Count engine requests a route runs itself (a score's continuations) against
        `tenant`'s requests in flight (TooManyRequestsError past the limit); release_work()
        gives them back."""
        limit = self.settings.max_requests_per_key
        with self._inflight_lock:
            _refuse_past_limit(self.inflight[tenant], num_requests, limit, _IN_FLIGHT)
            self.inflight[tenant] += num_requests

    def release_work(self, tenant: str, num_requests: int) -> None:
        """Give back what reserve_work() counted."""
        with self._inflight_lock:
            self.inflight[tenant] -= num_requests

    def add_kv_follower(self, tenant: str) -> None:
        """Count one more open KV event stream of `tenant`; past the per-key limit a
        TooManyRequestsError (429): the engine's loop hands every event to every follower."""
        limit = self.settings.max_kv_followers_per_key
        with self._inflight_lock:
            _refuse_past_limit(self._kv_followers[tenant], 1, limit, _KV_FOLLOWERS)
            self._kv_followers[tenant] += 1

    def remove_kv_follower(self, tenant: str) -> None:
        """A KV event stream of `tenant` ended."""
        with self._inflight_lock:
            self._kv_followers[tenant] -= 1

    def num_kv_followers(self) -> int:
        """Open KV event streams, all tenants together."""
        with self._inflight_lock:
            return sum(self._kv_followers.values())

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

    async def wait(self, request: Request, handles: list[TenantHandle]) -> list[GenerateResult]:
        """Results of `handles`, aborting them if the client goes away meanwhile."""
        return await wait_results(request, self.engine, handles)


class TenantHandle:
    """A request as its tenant sees it: under the client's own id (`rid`), whatever id the
    engine runs it under (`engine_rid`). Made before the engine has the request: a cancel
    that comes first is applied when the engine's handle is attached."""

    def __init__(self, rid: str, engine_rid: str) -> None:
        self.rid = rid
        self.engine_rid = engine_rid
        self.future: Future[GenerateResult] = Future()  # the result, under the client's id
        self._handle: RequestHandle | None = None
        self._cancelled = False

    def attach(self, handle: RequestHandle) -> None:
        """Follow the engine's handle of this request (once)."""
        self._handle = handle
        handle.future.add_done_callback(self._resolve)
        if self._cancelled:
            handle.cancel()

    def cancel(self) -> None:
        """Abort the request (its result says finish_reason "abort")."""
        self._cancelled = True
        if self._handle is not None:
            self._handle.cancel()

    def result(self, timeout: float | None = None) -> GenerateResult:
        return self.future.result(timeout)

    async def aresult(self) -> GenerateResult:
        return await asyncio.wrap_future(self.future)

    async def achunks(self) -> AsyncIterator[StreamChunk]:
        """What the request produced since its previous chunk (chunks carry no id)."""
        async for chunk in self._attached().achunks():
            yield chunk

    async def astream(self) -> AsyncIterator[str]:
        """Text deltas."""
        async for delta in self._attached().astream():
            yield delta

    def _attached(self) -> RequestHandle:
        if self._handle is None:
            raise RuntimeError("the request was not submitted yet")
        return self._handle

    def _resolve(self, done: Future[GenerateResult]) -> None:
        error = done.exception()
        if error is not None:
            self.future.set_exception(error)
        else:
            result = done.result()
            update: dict = {"rid": self.rid}
            if result.error is not None and self.engine_rid != self.rid:
                update["error"] = result.error.replace(self.engine_rid, self.rid)
            self.future.set_result(result.model_copy(update=update))


_IN_FLIGHT = ("requests in flight", "retry when some finish")
_KV_FOLLOWERS = ("KV event followers", "close one first")


def _refuse_past_limit(
    num_held: int, num_more: int, limit: int, held_and_advice: tuple[str, str]
) -> None:
    """A TooManyRequestsError (429) if `num_more` would take an API key's `num_held` past its
    `limit`; the message names what it holds and what to do (`held_and_advice`)."""
    if num_held + num_more > limit:
        held, advice = held_and_advice
        raise TooManyRequestsError(f"this API key has {num_held} {held} (limit {limit}); {advice}")


def get_server(request: Request) -> Server:
    """The app's shared Server (a FastAPI dependency)."""
    return request.app.state.server


ServerDep = Annotated[Server, Depends(get_server)]
