"""@program: a Python function over a state `s`, run once, concurrently in batches, or traced."""

from __future__ import annotations

import asyncio
import functools
import inspect
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from flowlang.backends import get_default_backend
from flowlang.backends.base import Backend
from flowlang.batch import SharedPrefixPins
from flowlang.context import RunContext
from flowlang.errors import InstanceError
from flowlang.executor import StreamExecutor
from flowlang.graph import RequestGraph
from flowlang.state import ProgramState
from flowlang.tracing import trace


class Program:
    """A flowlang program; create with the `@program` decorator.

    >>> @program
    ... def qa(s, question):
    ...     s += "Q: " + question + "\\nA:"
    ...     s += gen("answer", max_new_tokens=16, stop="\\n")
    >>> qa.name
    'qa'
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise TypeError(f"@program {fn.__name__} needs the state as its first parameter")
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        functools.update_wrapper(self, fn)

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        namespace: str | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> ProgramState:
        """Run to completion and return the state (a failure raises ExecutionError)."""
        ctx, state, result = self._begin(args, kwargs, backend, namespace, priority)
        try:
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            state.return_value = result
            ctx.sync_all()
        finally:
            ctx.close_all()
        return state

    async def arun(
        self,
        *args: Any,
        backend: Backend | None = None,
        namespace: str | None = None,
        priority: int = 0,
        **kwargs: Any,
    ) -> ProgramState:
        """`await program.arun(...)`: native async programs run on the caller's event loop."""
        ctx, state, result = self._begin(args, kwargs, backend, namespace, priority)
        try:
            if inspect.isawaitable(result):
                result = await result
            state.return_value = result
            await asyncio.to_thread(ctx.sync_all)
        finally:
            ctx.close_all()
        return state

    def _begin(
        self,
        args: tuple,
        kwargs: dict,
        backend: Backend | None,
        namespace: str | None,
        priority: int,
    ) -> tuple[RunContext, ProgramState, Any]:
        """Start a run: a fresh context and state, and the body called (appending nodes)."""
        ctx = RunContext(backend or get_default_backend(), namespace, priority=priority)
        root = StreamExecutor(ctx)
        root.start()
        state = ProgramState(root)
        try:
            return ctx, state, self.fn(state, *args, **kwargs)
        except BaseException:
            ctx.close_all()
            raise

    def compile(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> RequestGraph:
        """Trace without generating: the request graph, its static prompts and prefix tree."""
        return trace(self.name, self.fn, backend or get_default_backend(), args, kwargs)

    def run_batch(
        self,
        batch: Sequence[Mapping[str, Any]],
        max_workers: int = 64,
        progress: bool = True,
        backend: Backend | None = None,
        namespace: str | None = None,
        min_shared_tokens: int = 32,
    ) -> list[ProgramState | InstanceError]:
        """Run many instances concurrently. Every instance is compiled first and the shared
        prefixes of the whole batch are pinned (each prefilled once); a pin is released when
        the last instance that reads it finishes. A failing instance yields an InstanceError
        (with its traceback) in its place; the others run to completion."""
        backend = backend or get_default_backend()
        graphs = [self.compile(backend=backend, **dict(args)) for args in batch]
        pins = SharedPrefixPins(
            backend, [g.first_prompt() for g in graphs], namespace, min_shared_tokens
        )
        results: list[ProgramState | InstanceError | None] = [None] * len(batch)
        bar = _progress_bar(len(batch), self.name) if progress else None
        try:
            with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(batch)))) as pool:
                pins.acquire(pool)
                futures = {
                    pool.submit(self.run, backend=backend, namespace=namespace, **dict(args)): i
                    for i, args in enumerate(batch)
                }
                for future in as_completed(futures):
                    index = futures[future]
                    try:
                        results[index] = future.result()
                    except Exception as err:  # noqa: BLE001 - reported per instance
                        results[index] = InstanceError(index, err, traceback.format_exc())
                    pins.finished(index)
                    if bar is not None:
                        bar.update(1)
        finally:
            pins.release_all()
            if bar is not None:
                bar.close()
        return results

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
