"""ProgramState: the `s` a program writes to. Appending never blocks; reading waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from flowlang.errors import ProgramError
from flowlang.executor import _END, RunContext, StreamExecutor, _ForkRecord
from flowlang.ir import Fork, Join, RoleBegin, RoleEnd
from flowlang.primitives import to_nodes


class ProgramState:
    """A stream of text and generations. `s += ...` appends, `s["name"]` waits for a value.

    >>> s += "Q: What is 2+2?\\nA:"          # doctest: +SKIP
    >>> s += gen("answer", max_new_tokens=8)  # doctest: +SKIP
    >>> s["answer"]                            # doctest: +SKIP
    """

    def __init__(self, executor: StreamExecutor) -> None:
        self._executor = executor
        self.return_value: Any = None  # what the program function returned

    # ------------------------------------------------------------------ writing
    def __iadd__(self, other: Any) -> ProgramState:
        for node in to_nodes(other):
            self._executor.submit(node)
        return self

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[ProgramState]:
        """`with s.user(): s += ...` builds one message."""
        self._executor.submit(RoleBegin(name))
        try:
            yield self
        finally:
            self._executor.submit(RoleEnd(name))

    def system(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("system")

    def user(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("user")

    def assistant(self) -> contextlib.AbstractContextManager[ProgramState]:
        return self.role("assistant")

    def fork(self, num_branches: int) -> list[ProgramState]:
        """Branches that continue from here; the shared prefix is computed once and pinned."""
        if not isinstance(num_branches, int) or num_branches < 1:
            raise ProgramError(f"fork() needs a positive number of branches, got {num_branches!r}")
        ex = self._executor
        fork_id = ex.ctx.next_fork_id()
        branches = [
            StreamExecutor(ex.ctx, f"{ex.branch_id}.{i}", (fork_id, num_branches))
            for i in range(num_branches)
        ]
        ex.forks[fork_id] = _ForkRecord(branches)
        ex.submit(Fork(fork_id, num_branches))
        states = [ProgramState(b) for b in branches]
        for state in states:
            state._fork_id = fork_id
        return states

    def join(self, branches: list[ProgramState], mode: str = "gather") -> None:
        """Wait for `branches` and gather their variables into lists on this state; with
        mode="concat", also append each branch's own text (and tokens) to this state."""
        if mode not in ("gather", "concat"):
            raise ProgramError(f"join mode must be 'gather' or 'concat', got {mode!r}")
        if not branches:
            raise ProgramError("join() needs the branches of a fork()")
        fork_ids = {getattr(b, "_fork_id", None) for b in branches}
        if len(fork_ids) != 1 or None in fork_ids:
            raise ProgramError("join() takes the branches of one fork() of this state")
        (fork_id,) = fork_ids
        record = self._executor.forks.get(fork_id)
        if record is None:
            raise ProgramError("join() takes branches forked from this state")
        if record.joined:
            raise ProgramError("these branches were already joined")
        if [b._executor for b in branches] != record.branches:
            raise ProgramError("join() needs all branches of the fork, in order")
        record.joined = True
        self._executor.submit(Join(fork_id, mode))

    # ------------------------------------------------------------------ reading
    def __getitem__(self, name: str) -> Any:
        return self._executor.get(name)

    async def aget(self, name: str) -> Any:
        """`await s.aget("name")` in async programs."""
        return await asyncio.to_thread(self._executor.get, name)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except KeyError:
            return default

    def text(self) -> str:
        self.sync()
        return self._executor.content.text

    def token_ids(self) -> list[int]:
        self.sync()
        return list(self._executor.content.ids)

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return [dict(m) for m in self._executor.content.messages]

    def meta(self, name: str) -> dict[str, Any]:
        self[name]
        return self._executor.meta[name]

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._executor.variables)

    def text_iter(self, name: str) -> Iterator[str]:
        """The text of gen `name` as it streams."""
        if name not in self._executor.declared:
            self._executor.get(name)  # raises the clear unknown-variable error
        stream = self._executor.streams[name]
        while (delta := stream.get()) is not _END:
            yield delta
        stream.put(_END)  # a later iteration ends too

    def sync(self) -> ProgramState:
        """Wait until everything appended so far has run (raises a failure)."""
        self._executor.sync()
        return self

    @property
    def program_id(self) -> str:
        return self._executor.ctx.program_id

    def __repr__(self) -> str:
        return f"ProgramState(program={self.program_id}, branch={self._executor.branch_id})"


def new_state(ctx: RunContext) -> ProgramState:
    executor = StreamExecutor(ctx)
    executor.start()
    return ProgramState(executor)
