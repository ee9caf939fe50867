"""`@sgl.function`: an SGLang program as a flowlang Program (`s` is an SGLangState).

`run` and `run_batch` take SGLang's arguments: the sampling ones become the run's defaults for
every gen that does not set them, the rest are the program's arguments. Running goes through
flowlang's Program, so an SGLang program gets the request graph, fork pins and batch pins.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from flowlang.backends import get_default_backend
from flowlang.backends.base import Backend
from flowlang.context import current_run
from flowlang.errors import InstanceError, ProgramError
from flowlang.graph import RequestGraph
from flowlang.program import Program
from flowlang.sglang.expr import sampling_fields
from flowlang.sglang.state import SGLangState
from runtime.protocol import SamplingParams

# SGLang's run()/run_batch() sampling arguments and their defaults
RUN_SAMPLING = {
    "max_new_tokens": 128,
    "n": 1,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}


class SglFunction:
    """An SGLang program; create with `@sgl.function`.

    >>> import flowlang.sglang as sgl
    >>> @sgl.function
    ... def qa(s, question):
    ...     s += "Q: " + question + "\\nA:" + sgl.gen("answer", max_tokens=16, stop="\\n")
    >>> qa.arg_names
    ['question']
    """

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens  # ignored: for API models' speculation
        self.bind_arguments = dict(bind_arguments or {})
        self.program = Program(func, state_type=SGLangState)
        params = list(inspect.signature(func).parameters.values())[1:]
        self.arg_names = [p.name for p in params]
        self.num_required = sum(p.default is inspect.Parameter.empty for p in params)
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise ProgramError(f"{self.func.__name__} has no arguments {unknown}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Backend | None = None,
        use_thread: bool = True,
        **kwargs: Any,
    ) -> SGLangState:
        """Run once; SGLang's sampling arguments (max_new_tokens, temperature, stop, ...) are
        defaults for its gens. `stream=True` returns at once (see `text_iter`). `use_thread`
        is ignored: nodes always run on a worker thread.

        Called from inside another program's body (SGLang's nested call), it runs on that
        program's backend and returns at once, as SGLang's does: the caller goes on (its next
        call overlaps this one) and waits only where it reads this state."""
        sampling, program_args = _split(kwargs)
        return self.program.run(  # type: ignore[return-value] - state_type is SGLangState
            *args,
            backend=backend,
            sampling=sampling,
            stream=stream or current_run() is not None,
            **{**program_args, **self.bind_arguments},
        )

    def run_batch(
        self,
        batch_kwargs: Sequence[Mapping[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling_kwargs: Any,
    ) -> list[SGLangState | FailedState] | Iterator[SGLangState | FailedState]:
        """Run many instances concurrently, their shared prefixes pinned once; each item is a
        dict of arguments or a list of them in order. A failed instance is a FailedState."""
        sampling, extra = _split(sampling_kwargs)
        if extra:
            raise TypeError(f"run_batch() got unexpected arguments {sorted(extra)}")
        batch = [{**self._as_kwargs(item), **self.bind_arguments} for item in batch_kwargs]
        if not batch:
            return iter([]) if generator_style else []
        workers = 64 if num_threads == "auto" else int(num_threads)
        results = self.program.run_batch(
            batch, max_workers=workers, progress=progress_bar, backend=backend, sampling=sampling
        )
        states = [FailedState(r) if isinstance(r, InstanceError) else r for r in results]
        return iter(states) if generator_style else states

    def _as_kwargs(self, item: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(item, Mapping):
            return dict(item)
        if not self.num_required <= len(item) <= len(self.arg_names):
            raise ProgramError(
                f"{self.func.__name__} takes {self.arg_names}; a batch item has {len(item)} values"
            )
        return dict(zip(self.arg_names, item, strict=False))

    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> RequestGraph:
        """Differs from SGLang: flowlang's request graph (`.dump()`, `.prefix_report(...)`)."""
        return self.compile(backend=backend, **kwargs)

    def compile(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> RequestGraph:
        """The request graph of one instance, without running it."""
        return self.program.compile(*args, backend=backend, **{**kwargs, **self.bind_arguments})

    def cache(self, backend: Backend | None = None) -> None:
        """Prefill the program's static prefix once (cached, not locked), as SGLang does."""
        backend = backend or get_default_backend()
        prompt = self.compile(backend=backend).first_prompt()
        if prompt:
            backend.pin(list(prompt)).release()

    def __call__(self, *args: Any, **kwargs: Any) -> SGLangState:
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """`@sgl.function` or `@sgl.function(num_api_spec_tokens=...)` (accepted, ignored)."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens)
    return lambda f: SglFunction(f, num_api_spec_tokens)


def _split(kwargs: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
    """SGLang's run-level sampling arguments (as SamplingParams) and the program's arguments."""
    given = {k: kwargs[k] for k in RUN_SAMPLING if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in RUN_SAMPLING}
    fields = sampling_fields({**RUN_SAMPLING, **given})
    try:
        return SamplingParams(**fields), rest
    except ValueError as err:
        raise ProgramError(f"run(): {err}") from err


class FailedState:
    """A run_batch instance that failed: `error()` returns its exception; reads raise it."""

    def __init__(self, failure: InstanceError) -> None:
        self.failure = failure

    def error(self) -> BaseException:
        """The instance's exception."""
        return self.failure.error

    def sync(self) -> None:
        """Raises the instance's exception."""
        raise self.failure.error

    def __getitem__(self, name: str) -> Any:
        raise self.failure.error

    def text(self) -> str:
        """Raises the instance's exception."""
        raise self.failure.error

    def messages(self) -> list[dict[str, str]]:
        """Raises the instance's exception."""
        raise self.failure.error

    def get_meta_info(self, name: str) -> Any:
        """Raises the instance's exception."""
        raise self.failure.error

    def __repr__(self) -> str:
        return f"FailedState({self.failure})"
