"""A batch file run as one batch: lines not yet in the results run concurrently through their
routes, in prefix order, with the prefixes they share pinned once (each released when its last
reader is recorded); every result is appended the moment it exists.

A line is recorded once, whatever happens: answered (any status but 429, which is retried), or
refused before it ran. A line still running when the batch is cancelled finishes and is
recorded; one not yet started is left for a rerun, and so is one whose route raises
LineDeferred (the server is going away: its 503 is no answer to keep)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.batches.lines import BatchLine, ParsedFile
from runtime.batches.progress import BatchProgress
from runtime.batches.results_file import ResultsFile, error_record, result_record
from runtime.prefix import shared_prefixes

log = logging.getLogger("flowlang.batch")
RETRY_AFTER_S = (0.05, 0.2, 1.0)  # a 429 (the tenant's limit of requests in flight) waits


class LineDeferred(Exception):
    """Raised by a route for a line it did not run and that must not be recorded (the server
    is shutting down): the line is left for a rerun, like one not yet started."""


class LineRoute(Protocol):
    """How lines of one url run."""

    def prompt(self, body: Mapping[str, Any]) -> tuple[str | None, list[int]] | None:
        """The (namespace, token ids) the line's first request starts with, for the shared
        pins; None when not known before it runs. Blocking (tokenizes); a bad body is None."""

    async def run(self, line: BatchLine) -> tuple[int, Any]:
        """The line's answer: (HTTP status, JSON body)."""

    def for_tenant(self, headers: Mapping[str, str], namespace: str | None) -> LineRoute:
        """This route for one tenant's batch (its API key and cache namespace)."""


class Releasable(Protocol):
    def release(self) -> None: ...


PinFn = Callable[[list[int], "str | None"], Releasable]


@dataclass
class _Pin:
    readers: set[int]  # positions (in the run's order) still to be recorded
    handle: Releasable | None = None


@dataclass
class BatchRunner:
    routes: Mapping[str, LineRoute]
    pin: PinFn | None = None  # None: nothing pinned (an engine without a prefix cache)
    max_in_flight: int = 64
    min_shared_tokens: int = 32
    progress: BatchProgress = field(default_factory=BatchProgress)

    async def run(
        self,
        parsed: ParsedFile,
        output: ResultsFile,
        errors: ResultsFile,
        cancel: asyncio.Event | None = None,
    ) -> BatchProgress:
        """Run every line of `parsed` that neither results file holds yet."""
        done = output.done | errors.done
        todo = [line for line in parsed.lines if line.key not in done]
        bad = [line for line in parsed.bad if line.key not in done]
        self.progress.begin(parsed.total, parsed.total - len(todo) - len(bad))
        for line in bad:
            errors.append(error_record(line.key, line.code, line.message))
            self.progress.line_finished(ok=False, ran=False)
        ordered, pins = await asyncio.to_thread(self._plan, todo)
        try:
            await self._run_lines(ordered, pins, output, errors, cancel or asyncio.Event())
        finally:
            for pin in pins:
                _release(pin)
        return self.progress

    def _plan(self, todo: Sequence[BatchLine]) -> tuple[list[BatchLine], list[_Pin]]:
        """The lines in prefix order (those of unknown prompt last) and their shared pins."""
        prompts = [self._prompt(line) for line in todo]
        order = sorted(
            range(len(todo)),
            key=lambda i: (prompts[i] is None, repr(prompts[i] and prompts[i][0]), prompts[i]),
        )
        ordered = [todo[i] for i in order]
        prompts = [prompts[i] for i in order]
        return ordered, self._pins(prompts)

    def _prompt(self, line: BatchLine) -> tuple[str | None, tuple[int, ...]] | None:
        found = self.routes[line.url].prompt(line.body)
        return None if found is None else (found[0], tuple(found[1]))

    def _pins(self, prompts: Sequence[tuple[str | None, tuple[int, ...]] | None]) -> list[_Pin]:
        """Each namespace's shared prefixes, prefilled once now (a few at a time)."""
        if self.pin is None:
            return []
        wanted: list[tuple[list[int], str | None, set[int]]] = []
        for namespace in {p[0] for p in prompts if p is not None}:
            ids = [p[1] if p is not None and p[0] == namespace else None for p in prompts]
            for prefix, readers in shared_prefixes(ids, self.min_shared_tokens):
                wanted.append((list(prefix), namespace, readers))
        pins = [_Pin(readers) for _, _, readers in wanted]
        with ThreadPoolExecutor(max_workers=4) as pool:
            handles = pool.map(lambda w: self._try_pin(w[0], w[1]), wanted)
            for pin, handle in zip(pins, handles, strict=True):
                pin.handle = handle
        return pins

    def _try_pin(self, ids: list[int], namespace: str | None) -> Releasable | None:
        try:
            return self.pin(ids, namespace)
        except Exception as err:  # noqa: BLE001 - a pin only saves work: the lines still run
            log.warning("batch: a shared prefix of %d tokens was not pinned: %s", len(ids), err)
            return None

    async def _run_lines(self, ordered, pins, output, errors, cancel: asyncio.Event) -> None:
        slots = asyncio.Semaphore(self.max_in_flight)
        tasks: list[asyncio.Task] = []
        for position, line in enumerate(ordered):
            await slots.acquire()
            if cancel.is_set():
                slots.release()
                break
            task = asyncio.create_task(self._run_one(line, output, errors))
            task.add_done_callback(lambda _t, p=position: (slots.release(), _finished(pins, p)))
            tasks.append(task)
        await asyncio.gather(*tasks)

    async def _run_one(self, line: BatchLine, output: ResultsFile, errors: ResultsFile) -> None:
        self.progress.line_started()
        ok, ran = False, True
        try:
            status, body = await self._answer(line)
            ok = 200 <= status < 300
            request_id = body.get("id") if isinstance(body, dict) else None
            record = result_record(line.key, status, body, str(request_id or line.id))
            (output if ok else errors).append(record)
        except LineDeferred:
            ran = False
        except Exception as err:  # noqa: BLE001 - a route's own failure is this line's error
            log.exception("batch line %d (%s) failed", line.number, line.custom_id)
            errors.append(error_record(line.key, "internal_error", f"{type(err).__name__}: {err}"))
        finally:
            if ran:
                self.progress.line_finished(ok)
            else:
                self.progress.line_deferred()

    async def _answer(self, line: BatchLine) -> tuple[int, Any]:
        route = self.routes[line.url]
        for wait_s in RETRY_AFTER_S:
            status, body = await route.run(line)
            if status != 429:
                return status, body
            await asyncio.sleep(wait_s)
        return await route.run(line)


def _finished(pins: Sequence[_Pin], position: int) -> None:
    for pin in pins:
        if position in pin.readers:
            pin.readers.discard(position)
            if not pin.readers:
                _release(pin)


def _release(pin: _Pin) -> None:
    if pin.handle is not None:
        pin.handle.release()
        pin.handle = None
