"""Tracing: a program run on a RecordingExecutor, which records its nodes and generates nothing.

The program writes to the same ProgramState as when it runs, so tracing checks every call the
same way. Reading a generated value (control flow that depends on a generation) stops the trace:
the graph holds the static part and says why it ends there.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from flowlang.backends.base import Backend
from flowlang.content import Content, Renderer
from flowlang.graph import Branches, RequestGraph, RequestInfo, Stream
from flowlang.ir import Fork, Gen, Join, Node, RoleBegin, RoleEnd, Select, Text
from flowlang.state import ProgramState


class StopTracing(Exception):
    """A traced program read something only a run produces; the trace ends there."""


@dataclass
class _PendingBranches:
    fork: Fork
    branches: list[RecordingExecutor]


class RecordingExecutor:
    """Records the nodes of one traced state (the root or a fork branch); runs none of them."""

    def __init__(
        self, program_id: str, branch_id: str = "0", fork_numbers: Iterator[int] | None = None
    ) -> None:
        self.program_id = program_id
        self.branch_id = branch_id
        self.items: list[Node | _PendingBranches] = []
        self._fork_numbers = fork_numbers or itertools.count(1)  # shared by the whole trace

    def submit(self, node: Node) -> None:
        """Record a node."""
        self.items.append(node)

    def fork(self, num_branches: int) -> tuple[str, list[RecordingExecutor]]:
        """Record a fork; its branches record into their own streams."""
        fork = Fork(f"f{next(self._fork_numbers)}", num_branches)
        branches = [
            RecordingExecutor(self.program_id, f"{self.branch_id}.{i}", self._fork_numbers)
            for i in range(num_branches)
        ]
        self.items.append(_PendingBranches(fork, branches))
        return fork.fork_id, branches

    def get(self, name: str) -> Any:
        """Stops the trace: the value is generated."""
        raise StopTracing(f"the program reads {name!r}, a generated value")

    def set(self, name: str, value: Any) -> None:
        """Nothing to record: a later read of `name` stops the trace like any read."""

    def meta(self, name: str) -> dict[str, Any]:
        """Stops the trace: meta exists once the node ran."""
        raise StopTracing(f"the program reads meta of {name!r}")

    def stream(self, name: str | None) -> Iterator[str]:
        """Stops the trace: the text is generated."""
        what = repr(name) if name is not None else "its text"
        raise StopTracing(f"the program streams {what}, a generated value")

    def settle(self, reading: str) -> tuple[Content, dict[str, Any]]:
        """Stops the trace: the content would hold generated text."""
        raise StopTracing(f"the program reads {reading}")

    def sync(self) -> None:
        """Nothing runs while tracing, so there is nothing to wait for."""

    def recorded(self) -> Stream:
        """The frozen stream of what this state recorded, branches included."""
        return Stream(
            tuple(
                Branches(i.fork, tuple(b.recorded() for b in i.branches))
                if isinstance(i, _PendingBranches)
                else i
                for i in self.items
            )
        )


@dataclass
class _Simulation:
    """Renders a recorded stream to find each request's prompt (static until a generation)."""

    renderer: Renderer
    requests: list[RequestInfo] = field(default_factory=list)

    def run(self, stream: Stream, content: Content, dynamic: bool, branch: str) -> bool:
        """Walk `stream` from `content`, noting each request; branches walk from a copy, and a
        concat join appends each branch's own part, as the executor does. Returns whether the
        content ends holding a generated value."""
        forks: dict[str, tuple[int, int, list[tuple[Content, bool]]]] = {}
        for item in stream.items:
            if isinstance(item, Branches):
                ends = []
                for i, sub in enumerate(item.streams):
                    copy = content.copy()
                    ends.append((copy, self.run(sub, copy, dynamic, f"{branch}.{i}")))
                forks[item.fork.fork_id] = (len(content.text), len(content.ids), ends)
            elif isinstance(item, Join) and item.mode == "concat":
                text_len, ids_len, ends = forks[item.fork_id]
                for end, end_dynamic in ends:
                    content.append(end.text[text_len:], end.ids[ids_len:])
                    dynamic = dynamic or end_dynamic
            elif isinstance(item, Text | RoleBegin | RoleEnd):
                self.renderer.apply(content, item)
            elif isinstance(item, Gen | Select):
                prompt = None if dynamic else tuple(content.ids)
                kind = "gen" if isinstance(item, Gen) else "select"
                self.requests.append(RequestInfo(kind, item.name, branch, prompt))
                dynamic = True  # what follows contains a generated value
        return dynamic


def trace(
    program_name: str,
    fn: Callable[..., Any],
    backend: Backend,
    args: tuple,
    kwargs: dict,
    state_type: type[ProgramState] = ProgramState,
) -> RequestGraph:
    """Call `fn` on a recording state; the RequestGraph of what it appended."""
    recorder = RecordingExecutor(program_name)
    reason = None
    try:
        result = fn(state_type(recorder), *args, **kwargs)
        if hasattr(result, "__await__"):
            result.close()
            reason = "async programs are not traced (their body runs only when awaited)"
    except StopTracing as stop:
        reason = str(stop)
    root = recorder.recorded()
    simulation = _Simulation(Renderer(backend))
    simulation.run(root, Content(), False, "0")
    return RequestGraph(program_name, root, tuple(simulation.requests), reason)
