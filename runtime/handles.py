"""What callers hold while the engine works: a request's handle (result and stream) and a pin's."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

from runtime.protocol import GenerateResult, PinInfo, StreamChunk

_DONE = object()  # ends a stream


class RequestHandle:
    """A submitted request: `result()` waits for it, iterating yields its text as it streams.

    Made with an event loop (`Engine.submit(..., loop=...)`), it streams to `astream()` (text)
    or `achunks()` (text, tokens, logprobs) instead.
    """

    def __init__(
        self,
        rid: str,
        cancel: Callable[[str], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.rid = rid
        self.future: Future[GenerateResult] = Future()
        self._cancel = cancel
        self._loop = loop
        self._deltas: queue.Queue = queue.Queue()
        self._adeltas: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._read = False  # a chunk went to an async reader (set on the event loop)
        # called with the result before any reader sees it (its trace span ends first)
        self._on_deliver: list[Callable[[GenerateResult], None]] = []
        self._delivered: GenerateResult | None = None
        self._deliver_lock = threading.Lock()

    def result(self, timeout: float | None = None) -> GenerateResult:
        return self.future.result(timeout)

    async def aresult(self) -> GenerateResult:
        return await asyncio.wrap_future(self.future)

    def __iter__(self) -> Iterator[str]:
        """Text deltas as they become final (stop strings are never shown)."""
        if self._adeltas is not None:
            raise RuntimeError("this handle streams to astream() (it was made with a loop)")
        while (chunk := self._deltas.get()) is not _DONE:
            if chunk.text:
                yield chunk.text

    def chunks(self) -> Iterator[StreamChunk]:
        """Everything produced since the previous chunk (handles made without a loop)."""
        if self._adeltas is not None:
            raise RuntimeError("this handle streams to achunks() (it was made with a loop)")
        while (chunk := self._deltas.get()) is not _DONE:
            yield chunk

    async def astream(self) -> AsyncIterator[str]:
        """Text deltas, for handles submitted with an event loop."""
        async for chunk in self.achunks():
            if chunk.text:
                yield chunk.text

    async def achunks(self) -> AsyncIterator[StreamChunk]:
        """Everything produced since the previous chunk, for handles submitted with a loop."""
        while (chunk := await self._adeltas.get()) is not _DONE:
            self._read = True
            yield chunk

    def cancel(self) -> None:
        self._cancel(self.rid)

    def when_delivered(self, fn: Callable[[GenerateResult], None]) -> None:
        """Call `fn(result)` as the result is delivered, before `result()` returns it to
        anyone (at once if it already was)."""
        with self._deliver_lock:
            delivered = self._delivered
            if delivered is None:
                self._on_deliver.append(fn)
                return
        fn(delivered)

    def retract(self, timeout_s: float) -> bool:
        """Drop the chunks pushed so far, unless a reader took one: True if dropped (a replica
        died and the request runs again elsewhere: a reader then sees only the second run).
        Runs on the event loop, after the pushes before it, so no reader can take one
        meanwhile. A handle without a loop cannot be checked against its reader: never."""
        if self._loop is None:
            return False
        dropped: Future[bool] = Future()

        def on_loop() -> None:
            if not self._read:
                while not self._adeltas.empty():
                    self._adeltas.get_nowait()
            dropped.set_result(not self._read)

        try:
            self._loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop is closed: nobody reads, nothing to keep apart
            return False
        try:
            return dropped.result(timeout_s)
        except TimeoutError:  # the loop is gone (shutting down): keep what was sent
            return False

    # called from the engine's loop thread
    def push_chunk(self, chunk: StreamChunk) -> None:
        if chunk.text or chunk.output_ids or chunk.prompt_logprobs is not None:
            self._put(chunk)

    def deliver(self, result: GenerateResult) -> None:
        """End the stream and resolve the result."""
        with self._deliver_lock:
            self._delivered = result
            hooks, self._on_deliver = self._on_deliver, []
        for hook in hooks:
            try:
                hook(result)
            except Exception:  # noqa: BLE001 - a hook (a trace) never keeps the result back
                logging.getLogger(__name__).exception("a request's delivery hook failed")
        self._put(_DONE)
        self.future.set_result(result)

    def _put(self, item: Any) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._adeltas.put_nowait, item)
        else:
            self._deltas.put(item)


class PinHandle:
    """A pinned prefix: locked in the cache until `release()` (or until this handle is dropped)."""

    def __init__(self, info: PinInfo, release: Callable[[str], None]) -> None:
        self.info = info
        self.pin_id = info.pin_id
        self._finalizer = weakref.finalize(self, release, info.pin_id)

    def release(self) -> None:
        self._finalizer()

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> PinHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
