"""@program: a Python function over a state `s`, run once, concurrently in batches, or traced."""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flowlang.backends import get_default_backend
from flowlang.backends.base import Backend
from flowlang.batch import BatchRun, batch_instance
from flowlang.batch_results import BatchResults, NoResults, RecordedRun
from flowlang.context import RunContext, body_ended, body_of, current_run
from flowlang.errors import InstanceError, ProgramError
from flowlang.executor import StreamExecutor
from flowlang.graph import RequestGraph
from flowlang.state import ProgramState
from flowlang.telemetry import program_span
from flowlang.tracing import trace
from runtime.protocol import SamplingParams


def no_priority(_args: Mapping[str, Any]) -> int:
    """run_batch's default priority: every instance alike."""
    return 0


class Program:
    """A flowlang program; create with the `@program` decorator.

    >>> @program
    ... def qa(s, question):
    ...     s += "Q: " + question + "\\nA:"
    ...     s += gen("answer", max_new_tokens=16, stop="\\n")
    >>> qa.name
    'qa'
    """

    def __init__(
        self, fn: Callable[..., Any], state_type: type[ProgramState] = ProgramState
    ) -> None:
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise TypeError(f"@program {fn.__name__} needs the state as its first parameter")
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        self.state_type = state_type  # what the body's `s` is (flowlang.sglang's state)
        functools.update_wrapper(self, fn)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        namespace: str | None = None,
        priority: int = 0,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        stream: bool = False,
        **kwargs: Any,
    ) -> ProgramState:
        """Run to completion and return the state (a failure raises ExecutionError).

        `sampling`: run-level SamplingParams fields for every gen that does not set them.
        `stream=True` returns at once while the body runs on a thread: `state.text_iter()`
        streams the text, other reads wait for what they read, a failure raises at a read."""
        ctx, state = self._start(backend, namespace, priority, sampling)
        if not stream:
            self._finish(ctx, state, args, kwargs)
            return state

        def body() -> None:
            try:
                self._finish(ctx, state, args, kwargs)
            except BaseException as err:  # noqa: BLE001 - surfaces at the reader's next read
                ctx.fail(err)

        state.body_thread = threading.Thread(target=body, daemon=True, name=f"{self.name}-body")
        state.body_thread.start()
        return state

    async def arun(
        self,
        *args: Any,
        backend: Backend | None = None,
        namespace: str | None = None,
        priority: int = 0,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """`await program.arun(...)`: native async programs run on the caller's event loop."""
        ctx, state = self._start(backend, namespace, priority, sampling)
        with ctx.span:  # current in this task while the body runs; ends once all is closed
            try:
                token = body_of(ctx)
                try:
                    result = self.fn(state, *args, **kwargs)
                    if inspect.isawaitable(result):
                        result = await result
                finally:
                    body_ended(token)
                state.return_value = result
                await asyncio.to_thread(ctx.sync_all)
            finally:
                ctx.close_all()
        return state

    def _start(
        self,
        backend: Backend | None,
        namespace: str | None,
        priority: int,
        sampling: SamplingParams | Mapping[str, Any] | None,
    ) -> tuple[RunContext, ProgramState]:
        """A fresh context and state for one run (its root stream started, empty)."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            try:
                sampling = SamplingParams(**sampling)
            except ValueError as err:
                raise ProgramError(f"{self.name}.run(sampling=...): {err}") from err
        outer = current_run()  # called from another program's body: its backend and namespace
        if outer is not None:
            backend = backend or outer.backend
            namespace = namespace if namespace is not None else outer.namespace
        ctx = RunContext(
            backend or get_default_backend(), namespace, priority=priority, sampling=sampling
        )
        ctx.span = program_span(self.name, ctx)  # the caller's current span is its parent
        root = StreamExecutor(ctx)
        root.start()
        return ctx, self.state_type(root)

    def _finish(self, ctx: RunContext, state: ProgramState, args: tuple, kwargs: dict) -> None:
        """Call the body (appending nodes), then wait for every state of the run."""
        with ctx.span:  # current on the body's thread; records a failure; ends after close_all
            try:
                token = body_of(ctx)
                try:
                    result = self.fn(state, *args, **kwargs)
                    if inspect.isawaitable(result):
                        result = asyncio.run(_awaited(result))
                finally:
                    body_ended(token)
                state.return_value = result
                ctx.sync_all()
            finally:
                ctx.close_all()

    def compile(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> RequestGraph:
        """Trace without generating: the request graph, its static prompts and prefix tree."""
        return trace(
            self.name, self.fn, backend or get_default_backend(), args, kwargs, self.state_type
        )

    def run_batch(
        self,
        batch: Sequence[Mapping[str, Any]],
        max_workers: int = 64,
        progress: bool = True,
        backend: Backend | None = None,
        namespace: str | None = None,
        min_shared_tokens: int = 32,
        sampling: SamplingParams | Mapping[str, Any] | None = None,
        results: str | os.PathLike | None = None,
        priority: Callable[[Mapping[str, Any]], int] = no_priority,
    ) -> list[ProgramState | InstanceError | RecordedRun]:
        """Run many instances concurrently. Every instance is compiled first and the shared
        prefixes of the whole batch are pinned (each prefilled once); a pin is released when
        the last instance that reads it finishes. A failing instance yields an InstanceError
        (with its traceback) in its place; the others run to completion. `sampling` is each
        run's (see `run`). The backend places the compiled instances (`Backend.plan_batch`;
        ClusterBackend: instances sharing the deepest prefixes on the same replica), and each
        group's shared prefixes are pinned where it runs.

        `results`: a file each finished instance is appended to as it ends (durable); a rerun
        with the same file runs only the instances not in it, and gives back the others as
        RecordedRun (their variables and return value read back).

        `priority`: each instance's from its arguments, higher first (docs/programs.md)."""
        outer = current_run()
        backend = backend or (outer.backend if outer is not None else get_default_backend())
        recorded = BatchResults(results, self.name, batch) if results is not None else NoResults()
        done = [recorded.recorded(i) for i in range(len(batch))]
        todo = [i for i, run in enumerate(done) if run is None]
        instances = [batch_instance(self.compile(backend=backend, **dict(batch[i]))) for i in todo]
        plan = backend.plan_batch(instances, namespace)

        run_in = functools.partial(self.run, namespace=namespace, sampling=sampling)

        def run_one(args: Mapping[str, Any], on: Backend) -> ProgramState:
            return run_in(backend=on, priority=priority(args), **args)

        def finished(position: int, state: Any) -> None:
            recorded.record(todo[position], state)

        bar = _progress_bar(len(todo), self.name) if progress else None
        run = BatchRun(
            [batch[i] for i in todo],
            instances,
            run_one,
            namespace,
            min_shared_tokens,
            max_workers,
            bar,
            finished,
        )
        try:
            for i, state in zip(todo, run.execute(plan), strict=True):
                done[i] = state
            return done
        finally:
            recorded.close()
            if bar is not None:
                bar.close()

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def program(fn: Callable[..., Any]) -> Program:
    """Decorate `def f(s, ...)` into a flowlang Program."""
    return Program(fn)


async def _awaited(awaitable):
    return await awaitable


def _progress_bar(total: int, name: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, unit="run")
