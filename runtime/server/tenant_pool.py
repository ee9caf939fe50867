"""A small pool of threads for a request's untrusted text work (rendering a chat template,
parsing tool calls out of a text), shared fairly between tenants.

Why not asyncio.to_thread: its default pool is the one every route shares (submitting,
tokenizing, stats), so a few slow templates from one client would hold everyone's threads. Here
each tenant runs at most `per_tenant` jobs at once; its other jobs wait in its own queue, holding
no thread, and a tenant with too many waiting gets a 429. A job that finishes hands its thread
back to the pool's queue (its tenant's next job goes to the back), so tenants take turns.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.server.errors import TooManyRequestsError


@dataclass(frozen=True, slots=True)
class _Job:
    work: Callable[[], Any]
    future: Future


class TenantPool:
    """`threads` worker threads; each tenant runs at most `per_tenant` jobs at once."""

    def __init__(self, threads: int, per_tenant: int, name: str) -> None:
        self.per_tenant = per_tenant
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._lock = threading.Lock()  # guards _running and _waiting
        self._running: Counter[str] = Counter()  # jobs per tenant given to the executor
        self._waiting: dict[str, deque[_Job]] = {}  # jobs per tenant held back

    async def run(self, tenant: str, max_waiting: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the pool as `tenant`'s job; a TooManyRequestsError (429) when the
        tenant already has `max_waiting` jobs waiting for a thread."""
        job = _Job(functools.partial(fn, *args), Future())
        with self._lock:
            if self._running[tenant] < self.per_tenant:
                self._running[tenant] += 1
                self._executor.submit(self._work, tenant, job)
            else:
                waiting = self._waiting.setdefault(tenant, deque())
                if len(waiting) >= max_waiting:
                    raise TooManyRequestsError(
                        f"this API key has {len(waiting)} chat templates or texts waiting to be "
                        f"processed (limit {max_waiting}); retry when some finish"
                    )
                waiting.append(job)
        return await asyncio.wrap_future(job.future)  # a cancelled caller's job is skipped

    def running(self, tenant: str) -> int:
        """How many of `tenant`'s jobs hold (or are queued for) a thread now."""
        with self._lock:
            return self._running[tenant]

    def _work(self, tenant: str, job: _Job) -> None:
        try:
            if job.future.set_running_or_notify_cancel():
                try:
                    result = job.work()
                except Exception as err:  # noqa: BLE001 - the caller receives it
                    job.future.set_exception(err)
                else:
                    job.future.set_result(result)
        finally:
            self._next(tenant)

    def _next(self, tenant: str) -> None:
        """The tenant's next waiting job goes to the back of the pool's queue, or its count
        drops."""
        with self._lock:
            waiting = self._waiting.get(tenant)
            if waiting:
                self._executor.submit(self._work, tenant, waiting.popleft())
                return
            self._waiting.pop(tenant, None)
            self._running[tenant] -= 1
            if self._running[tenant] <= 0:
                del self._running[tenant]


# chat planning (template render + tokenize) and tool-call parsing of request texts
TEXT_WORK = TenantPool(threads=4, per_tenant=2, name="text-work")
