"""Engine handles over HTTP: streamed as server-sent events or awaited whole; either way the
engine's work is aborted as soon as nobody is left to read it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from runtime.engine import Engine
from runtime.handles import RequestHandle
from runtime.protocol import GenerateResult
from runtime.server.errors import ClientGone

T = TypeVar("T")


def sse(
    engine: Engine, handles: list[RequestHandle], chunks: AsyncGenerator[str, None]
) -> StreamingResponse:
    """`chunks` as SSE `data:` frames ending in [DONE]; whatever of `handles` still runs when
    the stream stops early (client gone, error) is aborted."""

    async def frames() -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield f"data: {chunk}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            abort_unfinished(engine, handles)

    return StreamingResponse(frames(), media_type="text/event-stream")


async def wait_results(
    request: Request, engine: Engine, handles: list[RequestHandle]
) -> list[GenerateResult]:
    """Results of `handles`, aborting them (and raising ClientGone) if the client disconnects."""
    waiter = asyncio.gather(*(h.aresult() for h in handles))
    return await unless_gone(request, waiter, lambda: abort_unfinished(engine, handles))


async def unless_gone(request: Request, work: asyncio.Future[T], stop: Callable[[], None]) -> T:
    """The result of `work`; if the client disconnects first, `stop()` it, wait for it to
    wind down, and raise ClientGone."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=0.25)
        if done:
            return work.result()
        if await request.is_disconnected():
            stop()
            await asyncio.gather(work, return_exceptions=True)
            raise ClientGone()


def abort_unfinished(engine: Engine, handles: list[RequestHandle]) -> None:
    """Abort each of `handles` that has no result yet."""
    for handle in handles:
        if not handle.future.done():
            engine.abort(handle.rid)
