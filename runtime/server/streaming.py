"""Engine handles over HTTP: streamed as server-sent events or awaited whole; either way the
engine's work is aborted as soon as nobody is left to read it, or when the server's shutdown
drain runs out of time (then the client gets a 503, or a stream its terminal error frame)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.engine_api import EngineAPI
from runtime.handles import RequestHandle
from runtime.protocol import GenerateResult
from runtime.server.drain import Drain
from runtime.server.errors import ClientGone, ShuttingDownError, error_frame

T = TypeVar("T")

STOPPED_BY_SHUTDOWN = "the server shut down before this request finished; retry it"


class _EventStream(StreamingResponse):
    """A StreamingResponse that learns its app's shutdown drain when it starts sending."""

    def __init__(self, frames: Callable[[Drain], AsyncIterator[bytes]]) -> None:
        self._frames = frames
        super().__init__(self._content(), media_type="text/event-stream")
        self._drain: Drain | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._drain = scope["app"].state.drain
        await super().__call__(scope, receive, send)

    async def _content(self) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(self._frames(self._drain)) as frames:
            async for frame in frames:
                yield frame


def sse(
    engine: EngineAPI, handles: list[RequestHandle], chunks: AsyncGenerator[str, None]
) -> StreamingResponse:
    """`chunks` as SSE `data:` frames ending in [DONE]; whatever of `handles` still runs when
    the stream stops early (client gone, error, the shutdown drain's end) is aborted. A stream
    the drain stops ends with an error frame (503), never a cut connection."""

    async def frames(drain: Drain) -> AsyncIterator[bytes]:
        expired = asyncio.ensure_future(drain.wait_expired())
        step: asyncio.Future[str | None] | None = None  # the next chunk, raced with `expired`
        try:
            try:
                while True:
                    step = asyncio.ensure_future(anext(chunks, None))
                    await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                    if not step.done():
                        stopped = error_frame(ShuttingDownError(STOPPED_BY_SHUTDOWN))
                        yield f"data: {stopped}\n\n".encode()
                        break
                    chunk = step.result()
                    if chunk is None:
                        break
                    yield f"data: {chunk}\n\n".encode()
            finally:  # the generator cannot be closed while a step still runs it
                if step is not None and not step.done():
                    step.cancel()
                    await asyncio.gather(step, return_exceptions=True)
                await chunks.aclose()
            yield b"data: [DONE]\n\n"
        finally:
            expired.cancel()
            abort_unfinished(engine, handles)

    return _EventStream(frames)


async def interleave(streams: Sequence[AsyncIterator[T]]) -> AsyncGenerator[T, None]:
    """The items of all `streams` as each comes, whichever it comes from (a request's n
    choices side by side, as clients that render them together expect); ends when they all
    have, raises what one raises. Closing it stops them all."""
    queue: asyncio.Queue[tuple[bool, object]] = asyncio.Queue()  # (an item?, it | the end)

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((True, item))
                await asyncio.sleep(0)  # the others' items in between: buffered ones alternate
        except Exception as err:  # noqa: BLE001 - raised again where the items are read
            queue.put_nowait((False, err))
            return
        queue.put_nowait((False, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        num_open = len(tasks)
        while num_open:
            is_item, item = await queue.get()
            if is_item:
                yield item
            elif item is None:
                num_open -= 1
            else:
                raise item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_results(
    request: Request, engine: EngineAPI, handles: list[RequestHandle]
) -> list[GenerateResult]:
    """Results of `handles`, aborting them (and raising ClientGone) if the client disconnects."""
    waiter = asyncio.gather(*(h.aresult() for h in handles))
    return await unless_gone(request, waiter, lambda: abort_unfinished(engine, handles))


async def unless_gone(request: Request, work: asyncio.Future[T], stop: Callable[[], None]) -> T:
    """The result of `work`; if the client disconnects first, `stop()` it, wait for it to
    wind down, and raise ClientGone; if the shutdown drain runs out of time first, the same
    with ShuttingDownError (a 503)."""
    drain: Drain = request.app.state.drain
    while True:
        done, _ = await asyncio.wait({work}, timeout=0.25)
        if done:
            return work.result()
        gone = await request.is_disconnected()
        if gone or drain.expired:
            stop()
            await asyncio.gather(work, return_exceptions=True)
            raise ClientGone() if gone else ShuttingDownError(STOPPED_BY_SHUTDOWN)


def abort_unfinished(engine: EngineAPI, handles: list[RequestHandle]) -> None:
    """Abort each of `handles` that has no result yet."""
    for handle in handles:
        if not handle.future.done():
            handle.cancel()  # by the engine's id, which may differ from the client's
