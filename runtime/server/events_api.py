"""The KV event stream over HTTP: a router on another host follows a replica's radix tree.

`GET /v1/flowlang/kv_events` answers NDJSON: first `{"snapshot": seq, "stored": [...]}`, then
one event per line (runtime/cache/events.py) as the tree changes, until the client leaves. A
reader that falls behind gets a last line `{"error": ...}` and subscribes again. Behind a router
front (`--replicas N`) each replica has its own stream: `?replica=N`. The paths are every
tenant's prompts, so with API keys the route needs an admin key.

A stream waits for events on the event loop (it looks every FOLLOW_INTERVAL_S), never in a
worker thread: idle followers cost the other routes nothing. Each key may hold
`max_kv_followers_per_key` streams (429 beyond): the engine's loop hands every event to each.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from runtime.cache.events import KVEvent, KVEventsLostError, KVEventSubscription
from runtime.server.state import ServerDep

router = APIRouter(prefix="/v1/flowlang")

FOLLOW_INTERVAL_S = 0.05  # how often an idle stream looks for events and for its client
REMOTE_FOLLOW_INTERVAL_S = 0.25  # ... behind a router front, where each look is a Ray call


@router.get("/kv_events")
async def kv_events(
    request: Request, server: ServerDep, replica: Annotated[int | None, Query(ge=0)] = None
):
    """Stream the engine's (or one replica's) KV cache events, snapshot first, one JSON
    object per line."""
    # the engine names the replica or refuses it: a router front needs one, an engine is 0
    subscribe = functools.partial(server.engine.subscribe_kv_events, replica=replica)
    tenant = server.tenant(request)
    server.add_kv_follower(tenant)
    try:
        subscription = await asyncio.to_thread(subscribe)
    except BaseException:
        server.remove_kv_follower(tenant)
        raise
    lines = _lines(request, subscription, lambda: server.remove_kv_follower(tenant))
    return StreamingResponse(lines, media_type="application/x-ndjson")


async def _lines(
    request: Request, subscription: Any, ended: Callable[[], None]
) -> AsyncIterator[str]:
    """The stream's lines; `ended()` once it is over, however it ends."""
    try:
        snapshot = subscription.snapshot
        stored = [event.to_dict() for event in snapshot.stored]
        yield json.dumps({"snapshot": snapshot.seq, "stored": stored}) + "\n"
        drain = request.app.state.drain  # a shutdown ends the stream with a last line
        local = isinstance(subscription, KVEventSubscription)
        interval_s = FOLLOW_INTERVAL_S if local else REMOTE_FOLLOW_INTERVAL_S
        while not subscription.closed and not await request.is_disconnected():
            if drain.draining:
                yield json.dumps({"error": "the server is shutting down"}) + "\n"
                return
            try:
                events = await _poll(subscription, local)
            except KVEventsLostError as err:
                yield json.dumps({"error": str(err)}) + "\n"
                return
            for event in events:
                yield json.dumps(event.to_dict()) + "\n"
            if not events:
                await asyncio.sleep(interval_s)
    finally:
        subscription.close()
        ended()


async def _poll(subscription: Any, local: bool) -> list[KVEvent]:
    """The pending events, without waiting for more: this engine's subscription is a look
    under a lock its publisher holds only to append (fine on the event loop); a router
    front's is a Ray call, made in a worker thread that is given back at once."""
    if local:
        return subscription.poll(0.0)
    return await asyncio.to_thread(subscription.poll, 0.0)
