"""Batches running on the server's event loop: each a task that reads its input file, runs the
lines its results files do not hold yet (runner.py) and publishes those files.

    validating -> in_progress -> finalizing -> completed
         |              |-> cancelling -> cancelled      (cancel: lines not started never run)
         |              |-> expired                      (past expires_at: the rest are errors)
         '-> failed                                      (no input to run: empty, unreadable)

Every change is stored (store.py) before it is reported. A server that stops (shutdown, drain,
crash) leaves a batch in_progress with its finished lines in its results files; the next
server on the same directory resumes it, and the runner skips what is done, so no line runs or
is recorded twice. A batch runs in one server at a time: it holds the batch's lock file."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.batches.lines import BatchLine, ParsedFile, parse_lines
from runtime.batches.progress import BatchProgress
from runtime.batches.results_file import ResultsFile, error_record
from runtime.batches.runner import BatchRunner, LineDeferred, LineRoute, PinFn
from runtime.batches.store import BatchRecord, BatchStore
from runtime.errors import InvalidRequestError

log = logging.getLogger("flowlang.batch")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # resumed at a start
CANCELLABLE = ("validating", "in_progress", "cancelling")
BUSY_RETRY_S = (1.0, 5.0, 15.0)  # an engine busy (503) while serving: the line waits, retried

RoutesFor = Callable[[str], Mapping[str, LineRoute]]  # tenant -> url -> route; ValueError: none


@dataclass
class Job:
    """A batch running here: its record, progress, cancel event, results files."""

    record: BatchRecord
    progress: BatchProgress
    cancel: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    results: tuple[ResultsFile, ResultsFile] | None = None  # (output, errors) while open
    total: int = 0
    expired: bool = False
    deferred: bool = False  # stopped because the server is going away: resumed next start


class BatchJobs:
    """The batches of one server: started, resumed, cancelled, stopped at shutdown."""

    def __init__(
        self,
        store: BatchStore,
        routes_for: RoutesFor,
        pin: PinFn | None,
        stats: Callable[[], Mapping[str, float]],
        going_away: Callable[[], bool],
    ) -> None:
        self.store = store
        self.routes_for = routes_for
        self.pin = pin
        self.stats = stats
        self.going_away = going_away  # the server drains or its engine is gone
        self.jobs: dict[str, Job] = {}
        self.statuses: dict[str, str] = {}  # every stored batch's status, for /metrics
        self.stopping = False

    def resume_all(self) -> None:
        """Start every stored batch that was left unfinished (on the event loop)."""
        for record in self.store.batches():
            self.statuses[record.id] = record.status
            if record.status in ACTIVE and record.id not in self.jobs:
                self.start(record)

    def start(self, record: BatchRecord) -> None:
        """Run `record`'s batch in a task of this event loop."""
        job = Job(record, BatchProgress(stats=self.stats))
        self.jobs[record.id] = job
        self.statuses[record.id] = record.status
        job.task = asyncio.create_task(self._run(job), name=f"batch {record.id}")

    def describe(self, record: BatchRecord) -> dict[str, Any]:
        """The Batch object now: the stored one, with live counts while it runs here."""
        job = self.jobs.get(record.id)
        if job is None or job.results is None:
            return record.batch
        output, errors = job.results
        counts = {"total": job.total, "completed": output.records, "failed": errors.records}
        return job.record.batch | {"request_counts": counts}

    def cancel(self, record: BatchRecord) -> dict[str, Any]:
        """Stop starting lines of the batch; it ends cancelled once those running are done."""
        job = self.jobs.get(record.id)
        record = job.record if job is not None else record
        if record.status not in CANCELLABLE:
            raise InvalidRequestError(
                f"batch {record.id!r} is {record.status}: only a validating or in_progress "
                "batch can be cancelled"
            )
        if record.status != "cancelling":
            record.set_status("cancelling", "cancelling_at")
            self._save(record)
        if job is not None:
            job.cancel.set()
        return self.describe(record)

    def running_inputs(self, tenant: str) -> dict[str, str]:
        """input file id -> batch id, for `tenant`'s batches running here."""
        return {
            j.record.batch["input_file_id"]: j.record.id
            for j in self.jobs.values()
            if j.record.tenant == tenant
        }

    async def stop(self, grace_s: float) -> None:
        """At shutdown: start no more lines, give those running `grace_s` to finish (recorded),
        then stop the rest unrecorded. Every batch stays as stored, to resume next start."""
        self.stopping = True
        tasks = [job.task for job in self.jobs.values() if job.task is not None]
        for job in self.jobs.values():
            job.cancel.set()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, job: Job) -> None:
        record = job.record
        lock_fd = _lock(self.store.lock_path(record.id))
        if lock_fd is None:  # another server on this directory runs it
            self.jobs.pop(record.id, None)
            return
        try:
            parsed = await asyncio.to_thread(self._parse, record)
            if isinstance(parsed, ParsedFile):
                await self._run_lines(job, parsed)
                if not (job.deferred or self.stopping) or record.status == "cancelling":
                    await asyncio.to_thread(self._finish, job)
            else:
                self._fail(record, *parsed)
        except asyncio.CancelledError:
            log.info("batch %s stopped with the server; it resumes at the next start", record.id)
            raise
        except Exception as err:  # noqa: BLE001 - this batch fails, the server serves on
            log.exception("batch %s failed", record.id)
            self._fail(record, "internal_error", f"{type(err).__name__}: {err}")
        finally:
            self.jobs.pop(record.id, None)
            os.close(lock_fd)

    def _parse(self, record: BatchRecord) -> ParsedFile | tuple[str, str]:
        """The input file's lines, or why the batch cannot run: (error code, message)."""
        batch = record.batch
        try:
            path = self.store.file_path(record.tenant, batch["input_file_id"])
            with path.open("rb") as lines:
                parsed = parse_lines(lines, [batch["endpoint"]])
        except (KeyError, OSError) as err:
            return "invalid_input_file", f"input_file_id: cannot read it ({err})"
        if parsed.total == 0:
            return "empty_file", "input_file_id: the file has no lines"
        return parsed

    async def _run_lines(self, job: Job, parsed: ParsedFile) -> None:
        record, store = job.record, self.store
        if record.status == "validating":
            record.set_status("in_progress", "in_progress_at")
        job.total = parsed.total
        output = await asyncio.to_thread(ResultsFile, store.results_path(record.id, "output"))
        errors = await asyncio.to_thread(ResultsFile, store.results_path(record.id, "error"))
        job.results = (output, errors)
        self._save(record)
        try:
            if record.status == "in_progress":
                await self._run_runner(job, parsed, output, errors)
            if job.expired:
                _expire_rest(parsed, output, errors)
        finally:
            record.batch["request_counts"] = self.describe(record)["request_counts"]
            job.results = None
            output.close()
            errors.close()
            self._save(record)

    async def _run_runner(self, job: Job, parsed: ParsedFile, output, errors) -> None:
        routes = self.routes_for(job.record.tenant)
        deferring = {url: _Deferring(route, job, self) for url, route in routes.items()}
        runner = BatchRunner(deferring, pin=self.pin, progress=job.progress)
        wait_s = max(0.0, job.record.batch["expires_at"] - time.time())
        timer = asyncio.get_running_loop().call_later(wait_s, _expire, job)
        try:
            await runner.run(parsed, output, errors, job.cancel)
        finally:
            timer.cancel()
            for route in routes.values():
                if hasattr(route, "aclose"):
                    await route.aclose()

    def _finish(self, job: Job) -> None:
        """Publish the results files, then the batch's final status (each step stored)."""
        record = job.record
        final = {"cancelling": "cancelled", "finalizing": "completed", "in_progress": "completed"}
        status = "expired" if job.expired else final[record.status]
        if status == "completed" and record.status != "finalizing":
            record.set_status("finalizing", "finalizing_at")
            self._save(record)
        for kind, id_field in (("output", "output_file_id"), ("error", "error_file_id")):
            name = f"{record.id}_{kind}.jsonl"
            path = self.store.results_path(record.id, kind)
            file_id = record.result_file_ids[kind]
            record.batch[id_field] = self.store.publish(record.tenant, file_id, path, name)
        record.set_status(status, f"{status}_at")
        self._save(record)
        with contextlib.suppress(FileNotFoundError):
            self.store.lock_path(record.id).unlink()

    def _fail(self, record: BatchRecord, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": None, "line": None}
        record.batch["errors"] = {"object": "list", "data": [error]}
        record.set_status("failed", "failed_at")
        self._save(record)

    def _save(self, record: BatchRecord) -> None:
        self.store.save(record)
        self.statuses[record.id] = record.status


class _Deferring:
    """A line route that leaves a line unrecorded (LineDeferred) when the server is going
    away, and retries a busy engine's 503 a few times: neither is the line's answer."""

    def __init__(self, route: LineRoute, job: Job, jobs: BatchJobs) -> None:
        self.route, self.job, self.jobs = route, job, jobs

    def prompt(self, body: Mapping[str, Any]) -> tuple[str | None, list[int]] | None:
        return self.route.prompt(body)

    async def run(self, line: BatchLine) -> tuple[int, Any]:
        for wait_s in (*BUSY_RETRY_S, None):
            self._defer_if_going_away()
            status, body = await self.route.run(line)
            if status != 503 or wait_s is None:
                break
            self._defer_if_going_away()
            await asyncio.sleep(wait_s)
        return status, body

    def _defer_if_going_away(self) -> None:
        if self.jobs.stopping or self.jobs.going_away():
            self.job.deferred = True
            self.job.cancel.set()  # start no more lines either
            raise LineDeferred("the server is shutting down")


def _expire(job: Job) -> None:
    job.expired = True
    job.cancel.set()


def _expire_rest(parsed: ParsedFile, output: ResultsFile, errors: ResultsFile) -> None:
    """Past the completion window: every line not run is an error (OpenAI's batch_expired)."""
    done = output.done | errors.done
    for line in [*parsed.lines, *parsed.bad]:
        if line.key not in done:
            message = "the batch expired (its 24h completion window ended) before this line ran"
            errors.append(error_record(line.key, "batch_expired", message))


def _lock(path: os.PathLike) -> int | None:
    """An open descriptor holding `path` locked (released when closed), or None if another
    process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def summary(jobs: Sequence[Job]) -> dict[str, float]:
    """Lines by state, summed over running batches, and the prefill the engine saved since the
    earliest of them began (each batch's window is the whole engine's: the largest one)."""
    totals = dict.fromkeys(("total", "completed", "failed", "running", "skipped"), 0.0)
    saved = 0.0
    for job in jobs:
        snap = job.progress.snapshot()
        for state in totals:
            totals[state] += snap[state] or 0
        saved = max(saved, snap["prefill_saved_tokens"] or 0)
    return {**{f"lines_{k}": v for k, v in totals.items()}, "prefill_saved_tokens": saved}
