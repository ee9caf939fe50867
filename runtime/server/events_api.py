"""The KV event stream over HTTP: a router on another host follows a replica's radix tree.

`GET /v1/flowlang/kv_events` answers NDJSON: first `{"snapshot": seq, "stored": [...]}`, then
one event per line (runtime/cache/events.py) as the tree changes, until the client leaves. A
reader that falls behind gets a last line `{"error": ...}` and subscribes again. Behind a router
front (`--replicas N`) each replica has its own stream: `?replica=N`. The paths are every
tenant's prompts, so with API keys the route needs an admin key.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from runtime.cache.events import KVEventsLostError, KVEventSubscription
from runtime.errors import InvalidRequestError
from runtime.server.state import ServerDep

router = APIRouter(prefix="/v1/flowlang")

POLL_INTERVAL_S = 0.5  # how often a quiet stream checks that its client is still there


@router.get("/kv_events")
async def kv_events(
    request: Request, server: ServerDep, replica: Annotated[int | None, Query(ge=0)] = None
):
    """Stream the engine's (or one replica's) KV cache events, snapshot first, one JSON
    object per line."""
    engine = server.engine
    if hasattr(engine, "replica_ids"):  # a router front: it names the replica or refuses
        subscribe = functools.partial(engine.subscribe_kv_events, replica=replica)
    elif replica in (None, 0):
        subscribe = engine.subscribe_kv_events
    else:
        raise InvalidRequestError(
            f"this server is one engine (replica 0), not a front; got {replica}"
        )
    subscription = await asyncio.to_thread(subscribe)
    return StreamingResponse(_lines(request, subscription), media_type="application/x-ndjson")


async def _lines(request: Request, subscription: KVEventSubscription) -> AsyncIterator[str]:
    snapshot = subscription.snapshot
    try:
        stored = [event.to_dict() for event in snapshot.stored]
        yield json.dumps({"snapshot": snapshot.seq, "stored": stored}) + "\n"
        while not subscription.closed and not await request.is_disconnected():
            try:
                events = await asyncio.to_thread(subscription.poll, POLL_INTERVAL_S)
            except KVEventsLostError as err:
                yield json.dumps({"error": str(err)}) + "\n"
                return
            for event in events:
                yield json.dumps(event.to_dict()) + "\n"
    finally:
        subscription.close()
