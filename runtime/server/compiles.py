"""New grammars compiled before a request is submitted, awaited without holding a thread.

Submitting runs in the event loop's worker threads (tokenizing a large prompt must not stall
the loop); a request whose grammar is still compiling would hold one of them for as long as
the compile waits, and enough of them would leave none for unconstrained requests. So the
server first awaits the compile on the engine's compile queue (runtime/constrain/
compile_queue.py), then submits a request whose grammar is cached.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from runtime.constrain.compile_queue import CompileQueueFullError
from runtime.protocol import GenerateRequest
from runtime.server.errors import TooManyRequestsError

if TYPE_CHECKING:
    from runtime.engine_api import EngineAPI


async def compile_ahead(engine: EngineAPI, requests: list[GenerateRequest], tenant: str) -> None:
    """Compile the new constraints of `requests` on `engine`'s compile queue and wait for them;
    InvalidRequestError for a bad one, TooManyRequestsError when `tenant` has its limit of
    compiles queued."""
    try:
        futures = engine.compile_ahead(requests, tenant)
    except CompileQueueFullError as err:
        raise TooManyRequestsError(str(err)) from err
    if futures:
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
