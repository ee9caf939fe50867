"""Operations: the health probe and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from runtime.server.batches_api import batch_metrics
from runtime.server.metrics import prometheus_text
from runtime.server.state import ServerDep

router = APIRouter()


@router.get("/health")
async def health(server: ServerDep, request: Request):
    """Liveness probe (no API key needed): 503 once the engine's loop is gone, and while the
    server drains for shutdown (a balancer stops sending it requests)."""
    if not server.engine.is_alive:
        reason = server.engine.fatal_error or "the engine is closed"
        return JSONResponse({"status": "dead", "error": reason}, status_code=503)
    drain = request.app.state.drain
    if drain.draining:
        return JSONResponse({"status": "draining", "reason": drain.reason}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(server: ServerDep, request: Request):
    """Engine stats, HTTP counters and batches' progress as Prometheus text."""
    stats = await asyncio.to_thread(server.engine.stats)
    text = prometheus_text(
        stats,
        server.http_requests,
        server.http_errors,
        len(server.leases),
        server.leases.num_expired,
    )
    return text + await batch_metrics(request.app)
