"""Grammar compiles on a worker of their own, tenants taking turns, a few waiting per tenant.

A new constraint's trial compile may take its whole budget (COMPILE_BUDGET_S), and the probe
runs one trial at a time. Compiled on the threads that submit requests, twenty slow
constraints from one tenant would hold all of them, and another tenant's unconstrained request
would wait minutes for compiles it does not need. Here compiles wait for one thread that does
nothing else; the server awaits them before it submits, so a waiting compile holds no thread.
Tenants take turns (round robin), so one tenant's backlog delays another tenant's compile by
at most one of its compiles, and a tenant may have MAX_QUEUED_COMPILES_PER_TENANT compiles
queued or running (CompileQueueFullError beyond: a 429 over HTTP).

The thread runs at a lower priority (COMPILE_NICENESS), as the trial's child process and the
mask workers do: a grammar compiled again in the server's process (a large one, grammar.py)
takes only the cores the forward leaves idle, whatever kind of constraint it is.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from runtime.constrain.masks import lower_thread_priority

MAX_QUEUED_COMPILES_PER_TENANT = 8
COMPILE_NICENESS = 10  # added to the compile thread's nice value: the forward's threads first


class CompileQueueFullError(Exception):
    """A tenant already has its limit of grammar compiles queued or running."""


class CompileQueue:
    """Runs compile jobs one at a time on a daemon thread (started on first use), taking one
    job from each tenant in turn.

    >>> queue = CompileQueue()
    >>> queue.submit("tenant-a", lambda: 42).result()
    42
    """

    def __init__(self, max_per_tenant: int | None = None) -> None:
        self.max_per_tenant = max_per_tenant
        self._cond = threading.Condition()
        # tenant -> its jobs in arrival order; tenants in turn order (the next one first)
        self._waiting: OrderedDict[str, deque[tuple[Callable[[], Any], Future]]] = OrderedDict()
        self._num_jobs: Counter[str] = Counter()  # queued or running, per tenant
        self._worker: threading.Thread | None = None
        self.num_compiles = 0  # jobs run to the end

    @property
    def limit(self) -> int:
        """Jobs a tenant may have queued or running."""
        return self.max_per_tenant or MAX_QUEUED_COMPILES_PER_TENANT

    def num_jobs(self, tenant: str) -> int:
        """`tenant`'s jobs queued or running."""
        with self._cond:
            return self._num_jobs[tenant]

    def submit(self, tenant: str, job: Callable[[], Any]) -> Future:
        """Queue `job` for `tenant`: a Future of its result (or its exception)."""
        future: Future = Future()
        with self._cond:
            if self._num_jobs[tenant] >= self.limit:
                raise CompileQueueFullError(
                    f"this API key has {self._num_jobs[tenant]} grammar compiles queued or "
                    f"running (limit {self.limit}); retry when they finish"
                )
            self._num_jobs[tenant] += 1
            self._waiting.setdefault(tenant, deque()).append((job, future))
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="grammar-compiles", daemon=True
                )
                self._worker.start()
            self._cond.notify()
        return future

    def _next(self) -> tuple[str, Callable[[], Any], Future]:
        """The next job: the first tenant's oldest, and that tenant goes to the back."""
        with self._cond:
            while not self._waiting:
                self._cond.wait()
            tenant, jobs = self._waiting.popitem(last=False)
            job, future = jobs.popleft()
            if jobs:
                self._waiting[tenant] = jobs
            return tenant, job, future

    def _work(self) -> None:
        lower_thread_priority(COMPILE_NICENESS)
        while True:
            tenant, job, future = self._next()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(job())
                    except Exception as err:  # noqa: BLE001 - the caller's to handle
                        future.set_exception(err)
            finally:
                with self._cond:
                    self._num_jobs[tenant] -= 1
                    if not self._num_jobs[tenant]:
                        del self._num_jobs[tenant]
                    self.num_compiles += 1
