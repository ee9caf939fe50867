"""The KV event stream over HTTP: a router on another host follows a replica's radix tree.

`GET /v1/flowlang/kv_events` answers NDJSON: first `{"snapshot": seq, "stored": [...]}`, then
one event per line (runtime/cache/events.py) as the tree changes, until the client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from runtime.cache.events import KVEventSubscription
from runtime.server.state import ServerDep

router = APIRouter(prefix="/v1/flowlang")

POLL_INTERVAL_S = 0.5  # how often a quiet stream checks that its client is still there


@router.get("/kv_events")
async def kv_events(request: Request, server: ServerDep):
    """Stream the engine's KV cache events (snapshot first), one JSON object per line."""
    subscription = await asyncio.to_thread(server.engine.subscribe_kv_events)
    return StreamingResponse(_lines(request, subscription), media_type="application/x-ndjson")


async def _lines(request: Request, subscription: KVEventSubscription) -> AsyncIterator[str]:
    snapshot = subscription.snapshot
    try:
        stored = [event.to_dict() for event in snapshot.stored]
        yield json.dumps({"snapshot": snapshot.seq, "stored": stored}) + "\n"
        while not subscription.closed and not await request.is_disconnected():
            events = await asyncio.to_thread(subscription.poll, POLL_INTERVAL_S)
            for event in events:
                yield json.dumps(event.to_dict()) + "\n"
    finally:
        subscription.close()
