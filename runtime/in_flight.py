"""The engine's requests on their way through its loop thread: a generate request with the
handle its caller holds (a request id names one request in flight at a time), and the
requests a pin or a score runs to the end, whose errors reach their caller.

Every change to the scheduler is a command the engine posts to its loop thread (`post`); the
callbacks the scheduler calls (`on_delta`, `on_finish`) run there too.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from runtime.errors import InvalidRequestError, error_for_kind
from runtime.handles import PinHandle, RequestHandle
from runtime.intake import RequestIntake
from runtime.protocol import GenerateRequest, GraphHints, PinInfo
from runtime.results import result_of, stream_chunk_of
from runtime.scheduler.request import Req
from runtime.scheduler.scheduler import Scheduler


class InFlight:
    """Requests and pins handed to the loop thread, each until it finishes (or is released)."""

    def __init__(
        self,
        intake: RequestIntake,
        scheduler: Scheduler,
        post: Callable[[Callable[[], Any]], None],
        closed: Callable[[], bool],
    ) -> None:
        self._intake = intake
        self._scheduler = scheduler  # touched only by commands posted to the loop thread
        self._post = post  # raises EngineClosedError once the engine is closed
        self._closed = closed  # once closed, every request was aborted: aborts are moot
        self._rids: set[str] = set()  # in flight: a request id names one request (abort)
        self._rids_lock = threading.Lock()

    def submit(
        self, request: GenerateRequest, loop: asyncio.AbstractEventLoop | None
    ) -> RequestHandle:
        """Queue a request; its handle gets the chunks and the result."""
        req = self._intake.generate_req(request)
        with self._rids_lock:
            if request.rid in self._rids:
                raise InvalidRequestError(f"request id {request.rid!r} is already in flight")
            self._rids.add(request.rid)
        handle = RequestHandle(request.rid, self.abort, loop)
        req.on_delta = lambda r: handle.push_chunk(stream_chunk_of(r))
        req.on_finish = lambda r: self._finished(handle, r)
        self._post(lambda: self._scheduler.add(req))
        return handle

    def abort(self, rid: str) -> None:
        """Abort a waiting or running request, or release a pin (by its id)."""
        if not self._closed():
            self._post(lambda: self._scheduler.abort(rid))

    def pin(self, ids: list[int], namespace: str | None, hints: GraphHints | None) -> PinHandle:
        """Prefill token ids if they are not cached and lock them until released."""
        info, _ = self.pin_ids(ids, namespace, hints, False)
        return PinHandle(info, self.abort)

    def pin_ids(
        self, ids: list[int], namespace: str | None, hints: GraphHints | None, keep_row: bool
    ) -> tuple[PinInfo, torch.Tensor | None]:
        """Pin token ids; with `keep_row`, also return the last position's logprob row."""
        pin_id = new_pin_id()
        req = self._intake.pin_req(pin_id, ids, namespace, hints, keep_row)
        (finished,) = self.run_to_end([req])
        info = PinInfo(
            pin_id=pin_id,
            num_tokens=len(ids),
            cached_tokens=finished.usage.cached_tokens or 0,
            namespace=namespace,
        )
        return info, finished.logprobs.last

    def run_to_end(self, reqs: list[Req]) -> list[Req]:
        """Add requests in one command and wait for each to finish (or pin); raise the first
        error."""
        futures: list[Future[Req]] = []
        for req in reqs:
            done: Future[Req] = Future()
            req.on_finish = done.set_result
            futures.append(done)
        self._post(lambda: [self._scheduler.add(r) for r in reqs])
        finished = [f.result() for f in futures]
        for req in finished:
            if req.error:
                raise error_for_kind(req.error_kind, req.error)
        return finished

    def _finished(self, handle: RequestHandle, req: Req) -> None:
        with self._rids_lock:
            self._rids.discard(req.rid)
        try:
            handle.push_chunk(stream_chunk_of(req))
        finally:  # the result is delivered even if the caller's stream broke
            handle.deliver(result_of(req))


def unheld_pin(ids: list[int], namespace: str | None) -> PinHandle:
    """A pin without a prefix cache: nothing could read it, so nothing is computed or held
    (`info.held` is False) and releasing it is a no-op."""
    info = PinInfo(
        pin_id=new_pin_id(), num_tokens=len(ids), cached_tokens=0, namespace=namespace, held=False
    )
    return PinHandle(info, _release_nothing)


def new_pin_id() -> str:
    return f"pin-{uuid.uuid4().hex[:12]}"


def _release_nothing(pin_id: str) -> None:
    """An unheld pin's release: the scheduler never saw it."""
