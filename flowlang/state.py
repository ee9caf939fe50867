"""ProgramState: the `s` a program writes to, the one state API for running and for tracing.

Appending never blocks; reading waits. The state owns every user-facing method and checks
its arguments at the call; an Executor runs the nodes: StreamExecutor generates, the
tracer's RecordingExecutor only records them and stops the trace when a generated value is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from flowlang.content import Content
from flowlang.errors import ProgramError, UnknownVariableError
from flowlang.ir import JOIN_MODES, Join, Node, RoleEnd
from flowlang.primitives import role_begin, to_nodes, tool_results
from flowlang.tools import Call, ToolRun, run_calls

T = TypeVar("T")


class Executor(Protocol):
    """What runs a state's nodes; every read may block (running) or stop (tracing)."""

    program_id: str
    branch_id: str

    def submit(self, node: Node) -> None:
        """Append a node to this stream; returns at once."""

    def fork(self, num_branches: int) -> tuple[str, Sequence[Executor]]:
        """Append a fork; its id and one executor per branch."""

    def get(self, name: str) -> Any:
        """The value of variable `name`, once the node that defines it ran."""

    def set(self, name: str, value: Any, meta: dict[str, Any] | None = None) -> None:
        """Define variable `name` now (with `meta`, what s.meta(name) reports)."""

    def meta(self, name: str) -> dict[str, Any]:
        """What the node that defined `name` reported (tokens, scores, ...)."""

    def stream(self, name: str | None) -> Iterator[str]:
        """The text of gen `name` as it is generated; all the text appended if None."""

    def settle(self, reading: str) -> tuple[Content, dict[str, Any]]:
        """Content and variables once every node so far ran; `reading` names what is read."""

    def sync(self) -> None:
        """Wait until every node so far ran (raises a failure)."""


class ProgramState:
    """A stream of text and generations. `s += ...` appends, `s["name"]` waits for a value.

    >>> s += "Q: What is 2+2?\\nA:"          # doctest: +SKIP
    >>> s += gen("answer", max_new_tokens=8)  # doctest: +SKIP
    >>> s["answer"]                            # doctest: +SKIP
    """

    def __init__(self, executor: Executor, fork_id: str | None = None) -> None:
        self._executor = executor
        self._fork_id = fork_id  # the fork this state is a branch of
        self._forks: dict[str, list[ProgramState]] = {}  # forks of this state, by id
        self._joined: set[str] = set()
        self.return_value: Any = None  # what the program function returned
        # run(stream=True): the thread running the body; reads from other threads wait for it
        self.body_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ writing
    def __iadd__(self, other: Any) -> ProgramState:
        for node in to_nodes(other):
            self._executor.submit(node)
        return self

    @contextlib.contextmanager
    def role(self, name: str, tools: Sequence[Any] | None = None) -> Iterator[ProgramState]:
        """`with s.user(): s += ...` builds one message (showing `tools`, if given)."""
        self._executor.submit(role_begin(name, tools))
        try:
            yield self
        finally:
            self._executor.submit(RoleEnd(name))

    def system(
        self, tools: Sequence[Any] | None = None
    ) -> contextlib.AbstractContextManager[ProgramState]:
        """A system message: `with s.system(): ...` (`tools`: their definitions too)."""
        return self.role("system", tools)

    def user(self) -> contextlib.AbstractContextManager[ProgramState]:
        """A user message: `with s.user(): ...`."""
        return self.role("user")

    def assistant(self) -> contextlib.AbstractContextManager[ProgramState]:
        """An assistant message: `with s.assistant(): ...`."""
        return self.role("assistant")

    def fork(self, num_branches: int) -> list[ProgramState]:
        """Branches that continue from here; the shared prefix is computed once and pinned."""
        if not isinstance(num_branches, int) or num_branches < 1:
            raise ProgramError(f"fork() needs a positive number of branches, got {num_branches!r}")
        fork_id, executors = self._executor.fork(num_branches)
        branches = [type(self)(executor, fork_id) for executor in executors]
        self._forks[fork_id] = branches
        return list(branches)

    def run_tools(self, calls: Sequence[Call], name: str = "tool_results") -> list[Any]:
        """Run `calls` (s[name] of a gen with tools) at once on a thread pool and append their
        results, in call order, as the tool messages after the assistant's message.

        A tool that raises gives the model `{"error": "..."}` instead of ending the program.
        Variable `name` gets the results (an exception for a failed call); its meta holds
        "calls", "errors" (call id -> exception) and "texts" (what the model reads).

        >>> with s.assistant():                 # doctest: +SKIP
        ...     s += gen("step", tools=[calculator])
        >>> if not isinstance(s["step"], str):  # doctest: +SKIP
        ...     s.run_tools(s["step"])
        """
        if isinstance(calls, str | Call) or not all(isinstance(c, Call) for c in calls):
            raise ProgramError(
                "run_tools() takes the list of Calls of a gen with tools (s[name] when the "
                "model called; check `isinstance(s[name], str)` first: that is a text answer)"
            )
        # the calls' message must have run (and a trace stops here: tools run only in a run)
        self._settle("the results of tool calls")
        runs: list[ToolRun] = run_calls(list(calls))
        if runs:
            self._executor.submit(tool_results([(r.call, r.text) for r in runs]))
        values = [r.value if r.error is None else r.error for r in runs]
        meta = {
            "calls": [r.call for r in runs],
            "errors": {r.call.id: r.error for r in runs if r.error is not None},
            "texts": [r.text for r in runs],
        }
        self._executor.set(name, values, meta)
        return values

    def fork_tools(self, calls: Sequence[Call], name: str = "tool_result") -> list[ProgramState]:
        """Parallel calls as fork branches: the calls run at once, and branch i holds call i's
        result as its tool message, so each goes on with its own model work from a prefix
        computed once and pinned (then `join` them as any fork's branches).

        Variable `name` of branch i is call i's result (an exception for a failed call).

        >>> branches = s.fork_tools(s["step"])  # doctest: +SKIP
        >>> for b in branches:                  # doctest: +SKIP
        ...     b += assistant(gen("summary", max_new_tokens=32))
        >>> s.join(branches)                    # doctest: +SKIP
        """
        is_calls = not isinstance(calls, str | Call) and all(isinstance(c, Call) for c in calls)
        if not calls or not is_calls:
            raise ProgramError(
                "fork_tools() takes the non-empty list of Calls of a gen with tools (s[name] "
                "when the model called)"
            )
        self._settle("the results of tool calls")
        runs: list[ToolRun] = run_calls(list(calls))
        branches = self.fork(len(runs))
        for branch, run in zip(branches, runs, strict=True):
            branch._executor.submit(tool_results([(run.call, run.text)]))
            value = run.value if run.error is None else run.error
            branch._executor.set(name, value, {"call": run.call, "error": run.error})
        return branches

    def join(self, branches: list[ProgramState], mode: str = "gather") -> None:
        """Wait for `branches` and gather their variables into lists on this state; with
        mode="concat", also append each branch's own text (and tokens) to this state."""
        if mode not in JOIN_MODES:
            allowed = " or ".join(repr(m) for m in JOIN_MODES)
            raise ProgramError(f"join mode must be {allowed}, got {mode!r}")
        if not branches:
            raise ProgramError("join() needs the branches of a fork()")
        fork_ids = {b._fork_id if isinstance(b, ProgramState) else None for b in branches}
        if len(fork_ids) != 1 or None in fork_ids:
            raise ProgramError("join() takes the branches of one fork() of this state")
        (fork_id,) = fork_ids
        if fork_id not in self._forks:
            raise ProgramError("join() takes branches forked from this state")
        if fork_id in self._joined:
            raise ProgramError("these branches were already joined")
        if list(branches) != self._forks[fork_id]:
            raise ProgramError("join() needs all branches of the fork, in order")
        self._joined.add(fork_id)
        self._executor.submit(Join(fork_id, mode))

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        return self._while_body_runs(lambda: self._executor.get(name))

    def __setitem__(self, name: str, value: Any) -> None:
        """`s["name"] = value` defines a variable now (SGLang's set_var)."""
        self._executor.set(name, value)

    async def aget(self, name: str) -> Any:
        """`await s.aget("name")` in async programs."""
        return await asyncio.to_thread(self.__getitem__, name)

    def get(self, name: str, default: Any = None) -> Any:
        """`s[name]`, or `default` for a name no gen/select of this state defines."""
        try:
            return self[name]
        except KeyError:
            return default

    def text(self) -> str:
        """All text so far (waits for every node appended)."""
        content, _ = self._settle("its text")
        return content.text

    def token_ids(self) -> list[int]:
        """All token ids so far (waits for every node appended)."""
        content, _ = self._settle("its token ids")
        return list(content.ids)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages so far, as {"role", "content"} dicts."""
        content, _ = self._settle("its messages")
        return [dict(m) for m in content.messages]

    def meta(self, name: str) -> dict[str, Any]:
        """What the gen/select that defined `name` reported (token counts, scores, ...)."""
        return self._while_body_runs(lambda: self._executor.meta(name))

    def variables(self) -> dict[str, Any]:
        """Every variable of this state (waits for every node appended)."""
        _, variables = self._settle("its variables")
        return dict(variables)

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """The text of gen `name` as it streams; without a name, all the text of this state as
        it is appended (SGLang's form; ends when the program ends)."""

        def start() -> tuple[Iterator[str], str | None]:
            deltas = self._executor.stream(name)
            return deltas, next(deltas, None)  # waits for the first delta

        deltas, first = self._while_body_runs(start)
        if first is not None:
            yield first
            yield from deltas

    def sync(self) -> ProgramState:
        """Wait until everything appended so far has run (raises a failure)."""
        self._wait_for_body()
        self._executor.sync()
        return self

    def _settle(self, reading: str) -> tuple[Content, dict[str, Any]]:
        self._wait_for_body()
        return self._executor.settle(reading)

    def _wait_for_body(self) -> None:
        body = self.body_thread
        if body is not None and body is not threading.current_thread():
            body.join()

    def _while_body_runs(self, read: Callable[[], T]) -> T:
        """A read that may name what a streamed run's body has not appended yet: retried
        until the body has appended it or ended."""
        body = self.body_thread
        while True:
            try:
                return read()
            except UnknownVariableError:
                if body is None or body is threading.current_thread() or not body.is_alive():
                    raise
                body.join(0.005)

    @property
    def program_id(self) -> str:
        return self._executor.program_id

    def __repr__(self) -> str:
        return f"ProgramState(program={self.program_id}, branch={self._executor.branch_id})"
