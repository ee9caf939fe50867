"""OpenAI's Batch API: `/v1/batches` (create, retrieve, list, cancel) over the files of
files_api.py. A batch runs on the server's own event loop (runtime/batches/jobs.py): each line
is posted through this app in-process, as its owner (the owner's API key, so its limits and
cache namespace apply), and answered exactly as the same request over HTTP would be.

Batches live in `ServerSettings.batch_dir` (runtime/batches/store.py): at startup the server
resumes those left unfinished; at shutdown it starts no more lines and leaves them to resume."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from pydantic import BaseModel, ConfigDict

from runtime.batches.jobs import BatchJobs, Job, summary
from runtime.batches.openai_lines import CHAT_URL, COMPLETIONS_URL, openai_routes
from runtime.batches.runner import LineRoute
from runtime.batches.store import BatchStore, page
from runtime.errors import InvalidRequestError, UnknownRequestError
from runtime.server.metrics import batch_text
from runtime.server.state import Server, ServerDep

router = APIRouter(prefix="/v1")
log = logging.getLogger("flowlang.server")

COMPLETION_WINDOWS_S = {"24h": 24 * 3600}  # OpenAI's only window


class BatchBody(BaseModel):
    """POST /v1/batches: every field OpenAI defines; `output_expires_after` is ignored (the
    output files are kept until deleted)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Any = None
    output_expires_after: Any = None


def batch_dir(server: Server) -> Path:
    """The settings' batch_dir, else `batches` in flowlang's cache folder."""
    from runtime.model.registry import cache_dir  # torch-free

    return Path(server.settings.batch_dir or cache_dir() / "batches").expanduser()


def batch_jobs(app: FastAPI) -> BatchJobs:
    """The app's batches (made on first use: the lifespan's start, or the first request)."""
    jobs = getattr(app.state, "batch_jobs", None)
    if jobs is None:
        server: Server = app.state.server
        engine = server.engine
        jobs = BatchJobs(
            BatchStore(batch_dir(server)),
            lambda tenant: _routes_for(app, tenant),
            engine.pin if engine.caches_prefixes else None,
            engine.stats,
            lambda: app.state.drain.draining or not engine.is_alive,
        )
        app.state.batch_jobs = jobs
    return jobs


def start_batches(app: FastAPI) -> None:
    """At startup: resume the batches a previous server left unfinished (an unreadable
    batch directory is logged: the server still serves everything else)."""
    try:
        batch_jobs(app).resume_all()
    except OSError as err:
        log.error("batches: cannot resume those in %s: %s", batch_dir(app.state.server), err)


async def stop_batches(app: FastAPI, grace_s: float) -> None:
    """At shutdown, before the engine closes: stop the batches (they resume next start)."""
    jobs = getattr(app.state, "batch_jobs", None)
    if jobs is not None:
        await jobs.stop(grace_s)


def endpoints(app: FastAPI) -> list[str]:
    """The urls a batch may run: the OpenAI routes and the extensions' line routes."""
    return [CHAT_URL, COMPLETIONS_URL, *app.state.line_routes]


def _routes_for(app: FastAPI, tenant: str) -> dict[str, LineRoute]:
    """The line routes of `tenant`'s batches: posted with its API key, in its namespace."""
    server: Server = app.state.server
    headers = {}
    if server.keys:
        key = next((k for k, tag in server.keys.items() if tag == tenant), None)
        if key is None:
            raise InvalidRequestError(
                "the batch's API key is no longer configured on this server: its lines cannot "
                "run as their owner"
            )
        headers["Authorization"] = f"Bearer {key}"
    elif tenant != "anonymous":
        raise InvalidRequestError("the batch was created with an API key; this server has none")
    namespace = tenant if server.keys else None  # Server.namespace's salt
    routes: dict[str, LineRoute] = dict(openai_routes(app, server.engine, headers, namespace))
    extra = app.state.line_routes  # a layer above's (flowlang's programs), for this tenant too
    return routes | {url: route.for_tenant(headers, namespace) for url, route in extra.items()}


@router.post("/batches")
async def create_batch(body: BatchBody, request: Request, server: ServerDep) -> dict:
    """Start a batch over an uploaded file (purpose "batch") of the caller's."""
    urls = endpoints(request.app)
    if body.endpoint not in urls:
        raise InvalidRequestError(
            f"endpoint {body.endpoint!r} is not supported: one of {', '.join(urls)}"
        )
    window_s = COMPLETION_WINDOWS_S.get(body.completion_window)
    if window_s is None:
        raise InvalidRequestError(
            f"completion_window must be '24h' (OpenAI's only window), not "
            f"{body.completion_window!r}"
        )
    metadata = check_metadata(body.metadata)
    tenant = server.tenant(request)
    jobs = batch_jobs(request.app)
    try:
        input_file = await asyncio.to_thread(jobs.store.file, tenant, body.input_file_id)
    except UnknownRequestError as err:
        raise UnknownRequestError(f"input_file_id: {err}") from None
    if input_file["purpose"] != "batch":
        raise InvalidRequestError(
            f"input_file_id: file {body.input_file_id!r} has purpose "
            f"{input_file['purpose']!r}, not 'batch'"
        )
    record = await asyncio.to_thread(
        jobs.store.new_batch, tenant, _new_batch(body, window_s, metadata)
    )
    jobs.start(record)
    return jobs.describe(record)


def _new_batch(body: BatchBody, window_s: int, metadata: dict | None) -> dict[str, Any]:
    now = int(time.time())
    batch: dict[str, Any] = {"id": None, "object": "batch", "endpoint": body.endpoint}
    batch |= dict(errors=None, input_file_id=body.input_file_id)
    batch |= dict(completion_window=body.completion_window, status="validating")
    batch |= dict(output_file_id=None, error_file_id=None, created_at=now)
    for stamp in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling"):
        batch[f"{stamp}_at"] = None
    batch |= dict(cancelled_at=None, expires_at=now + window_s, metadata=metadata)
    batch["request_counts"] = {"total": 0, "completed": 0, "failed": 0}
    return batch


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    if metadata is None:
        return None
    ok = isinstance(metadata, dict) and len(metadata) <= 16
    ok = ok and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
        for k, v in metadata.items()
    )
    if not ok:
        raise InvalidRequestError(
            "metadata must map at most 16 keys (up to 64 characters) to strings (up to 512)"
        )
    return dict(metadata)


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, server: ServerDep) -> dict:
    """The caller's batch `batch_id` (404 for anyone else's)."""
    jobs = batch_jobs(request.app)
    record = await asyncio.to_thread(jobs.store.batch, server.tenant(request), batch_id)
    return jobs.describe(record)


@router.get("/batches")
async def list_batches(
    request: Request, server: ServerDep, after: str | None = None, limit: int = 20
) -> dict:
    """The caller's batches, newest first (OpenAI's cursor page)."""
    jobs = batch_jobs(request.app)
    records = await asyncio.to_thread(jobs.store.batches, server.tenant(request))
    return page([jobs.describe(record) for record in records], after, limit)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, server: ServerDep) -> dict:
    """Cancel the caller's batch: no more lines start; it ends `cancelled`."""
    jobs = batch_jobs(request.app)
    record = await asyncio.to_thread(jobs.store.batch, server.tenant(request), batch_id)
    return jobs.cancel(record)


async def batch_metrics(app: FastAPI) -> str:
    """The batches' part of /metrics: lines of running batches, batches by status."""
    jobs: BatchJobs | None = getattr(app.state, "batch_jobs", None)
    if jobs is None:
        return batch_text(summary([]), Counter())
    running = list(jobs.jobs.values())
    lines = await asyncio.to_thread(summary, running)
    return batch_text(lines, Counter(jobs.statuses.values()))


async def batch_rows(app: FastAPI, tenant: str | None) -> list[dict]:
    """The live page's rows: running batches (of `tenant`, if given), with rate and ETA."""
    jobs: BatchJobs | None = getattr(app.state, "batch_jobs", None)
    if jobs is None:
        return []
    running = [j for j in jobs.jobs.values() if tenant in (None, j.record.tenant)]
    return await asyncio.to_thread(lambda: [_row(job) for job in running])


def _row(job: Job) -> dict:
    snap = job.progress.snapshot()
    shown = ("total", "completed", "failed", "running", "skipped", "rate_per_s", "eta_s")
    return {"id": job.record.id, "status": job.record.status} | {k: snap[k] for k in shown}
