"""StreamExecutor: runs one state's IR nodes in order on a worker thread.

The program thread only appends nodes (so it runs ahead and exposes future work); reading a
variable waits for the node that defines it. This file is the one place that dispatches on
node kind.
"""

from __future__ import annotations

import queue
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flowlang.backends.base import Backend, PinLease
from flowlang.content import Content, Renderer
from flowlang.errors import (
    ExecutionError,
    FlowlangError,
    InvalidOutputError,
    ProgramError,
    UnknownVariableError,
)
from flowlang.ir import Fork, Gen, Join, Node, RoleBegin, RoleEnd, Select, Text
from runtime.protocol import GenerateRequest, GraphHints, ScoreRequest

_END = object()


@dataclass
class RunContext:
    """Shared by every state of one program run."""

    backend: Backend
    namespace: str | None = None
    program_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    priority: int = 0
    pins: list[PinLease] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fork_count: int = 0
    executors: list[StreamExecutor] = field(default_factory=list)
    error: BaseException | None = None

    def next_fork_id(self) -> str:
        with self.lock:
            self.fork_count += 1
            return f"{self.program_id}-f{self.fork_count}"

    def fail(self, err: BaseException) -> None:
        """The first failure stops the whole run: every state drains and wakes its readers."""
        with self.lock:
            if self.error is None:
                self.error = err
            executors = list(self.executors)
        for executor in executors:
            executor.wake_all()

    def sync_all(self) -> None:
        """Wait for every state of the run; raise the first failure."""
        first: BaseException | None = None
        index = 0
        while index < len(self.executors):
            executor = self.executors[index]
            try:
                executor.sync()
            except ExecutionError as err:
                first = first or err
            index += 1
        if first is not None:
            raise first

    def close_all(self) -> None:
        for executor in list(self.executors):
            executor.close()
        with self.lock:
            pins, self.pins = self.pins, []
        for pin in pins:
            pin.release()


@dataclass
class _ForkRecord:
    branches: list[StreamExecutor]
    pin: PinLease | None = None
    joined: bool = False
    text_len: int = 0  # the parent's content when it forked: where branches' own parts start
    ids_len: int = 0


class StreamExecutor:
    def __init__(
        self, ctx: RunContext, branch_id: str = "0", fork_group: tuple[str, int] | None = None
    ) -> None:
        self.ctx = ctx
        self.branch_id = branch_id
        self.fork_group = fork_group
        self.renderer = Renderer(ctx.backend)
        self.content = Content()
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.declared: set[str] = set()
        self.streams: dict[str, queue.Queue] = defaultdict(queue.Queue)
        self.forks: dict[str, _ForkRecord] = {}
        self.error: BaseException | None = None
        self._events: dict[str, threading.Event] = defaultdict(threading.Event)
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"flowlang-{ctx.program_id}-{branch_id}"
        )
        with ctx.lock:
            ctx.executors.append(self)
        self._thread.start()
        if ctx.error is not None:
            self.wake_all()

    # ------------------------------------------------------------------ program side
    def start(self, content: Content | None = None) -> None:
        """Begin executing (branches start once the parent reaches the fork)."""
        if content is not None:
            self.content = content
        self._started.set()

    def submit(self, node: Node) -> None:
        if isinstance(node, Gen | Select):
            self.declared.add(node.name)
        with self._idle:
            self._pending += 1
        self._queue.put(node)

    def get(self, name: str) -> Any:
        """The value of variable `name`, waiting for the node that defines it."""
        if name not in self.declared and name not in self.variables:
            known = sorted(self.declared | set(self.variables))
            raise UnknownVariableError(
                f"no gen/select defines {name!r} in this state; defined: {known}"
            )
        self._events[name].wait()
        if name not in self.variables:
            cause = self.error or self.ctx.error
            if isinstance(cause, FlowlangError):
                raise cause
            raise ExecutionError(f"{name!r} was not produced: {cause!r}") from cause
        return self.variables[name]

    def sync(self) -> None:
        """Wait until every submitted node ran; raise the first failure."""
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)
        cause = self.error or self.ctx.error
        if isinstance(cause, FlowlangError):
            raise cause  # already says what went wrong
        if cause is not None:
            raise ExecutionError(f"program failed: {cause!r}") from cause

    def close(self) -> None:
        self._started.set()
        self._queue.put(_END)

    def wake_all(self) -> None:
        """Unblock readers and let the queue drain (after a failure in the run)."""
        self._started.set()
        for event in list(self._events.values()):
            event.set()
        for stream in list(self.streams.values()):
            stream.put(_END)

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        self._started.wait()
        while (node := self._queue.get()) is not _END:
            try:
                if self.error is None and self.ctx.error is None:
                    self._execute(node)
            except BaseException as err:  # noqa: BLE001 - kept and re-raised on the program side
                self.error = err
                self.ctx.fail(err)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _execute(self, node: Node) -> None:
        if isinstance(node, Text | RoleBegin | RoleEnd):
            self.renderer.apply(self.content, node)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, Fork):
            self._fork(node)
        elif isinstance(node, Join):
            self._join(node)
        else:
            raise ProgramError(f"unknown node {node!r}")

    def _hints(self) -> GraphHints:
        group_id, group_size = self.fork_group or (None, None)
        return GraphHints(
            program_id=self.ctx.program_id,
            branch_id=self.branch_id,
            fork_group_id=group_id,
            fork_group_size=group_size,
            priority=self.ctx.priority,
            continuation=not self._queue.empty(),
        )

    def _gen(self, node: Gen) -> None:
        if not self.content.ids:
            raise ProgramError(f"gen({node.name!r}) needs a prompt: add text first")
        request = GenerateRequest(
            input_ids=list(self.content.ids),
            sampling=node.params,
            constraint=node.constraint,
            hints=self._hints(),
            namespace=self.ctx.namespace,
        )
        handle = self.ctx.backend.generate(request)
        stream = self.streams[node.name]
        for delta in handle:
            stream.put(delta)
        result = handle.result()
        stream.put(_END)
        if result.finish_reason == "error":
            raise ExecutionError(f"gen({node.name!r}) failed: {result.error}")
        ids = list(result.output_ids)
        if isinstance(result.matched_stop, str):
            ids = self.ctx.backend.tokenize(result.text)  # the text was cut inside a token
        elif result.matched_stop is not None and ids and ids[-1] == result.matched_stop:
            ids = ids[:-1]  # the stop token is markup, not content (roles add their own)
        self.content.append(result.text, ids)
        meta = {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "completion_tokens": result.completion_tokens,
            "finish_reason": result.finish_reason,
            "output_ids": list(result.output_ids),
            "logprobs": result.logprobs,
            "raw_text": result.text,
        }
        value = result.text
        if node.parse is not None:
            try:
                value = node.parse(result.text)
            except ValueError as err:  # pydantic's ValidationError is a ValueError
                self.meta[node.name] = meta
                cut = (
                    f"cut by max_new_tokens={node.params.max_new_tokens}"
                    if result.finish_reason == "length"
                    else f"ended by {result.finish_reason}"
                )
                raise InvalidOutputError(
                    f"gen({node.name!r}) {cut} after {result.completion_tokens} tokens; its text "
                    f"is not a valid {node.parse_label}: {str(err).splitlines()[0]}; raw text: "
                    f"{result.text!r}"
                ) from err
        self._define(node.name, value, meta)

    def _select(self, node: Select) -> None:
        from flowlang.selection import choose

        if not self.content.ids:
            raise ProgramError(f"select({node.name!r}) needs a prompt: add text first")
        backend = self.ctx.backend
        choice_ids = [backend.tokenize(c) for c in node.choices]
        scored = backend.score(
            ScoreRequest(
                prefix=list(self.content.ids),
                continuations=choice_ids,
                hints=self._hints(),
                namespace=self.ctx.namespace,
            )
        )
        unconditional = None
        if node.method == "unconditional_likelihood_normalized":
            base = self.content.open_role_prefix_ids or self.content.ids[:1]
            unconditional = backend.score(
                ScoreRequest(
                    prefix=list(base), continuations=choice_ids, namespace=self.ctx.namespace
                )
            )
        index, scores = choose(
            node.method,
            choice_ids,
            scored.token_logprobs,
            unconditional.token_logprobs if unconditional else None,
        )
        self.content.append(node.choices[index], choice_ids[index])
        self._define(
            node.name,
            node.choices[index],
            {
                "method": node.method,
                "scores": scores,
                "choices": list(node.choices),
                "token_logprobs": scored.token_logprobs,
            },
        )

    def _fork(self, node: Fork) -> None:
        record = self.forks[node.fork_id]
        record.text_len, record.ids_len = len(self.content.text), len(self.content.ids)
        if len(self.content.ids) > 0:
            # the shared prefix is prefilled once and locked while the branches run
            record.pin = self.ctx.backend.pin(
                list(self.content.ids), self.ctx.namespace, self._hints()
            )
            with self.ctx.lock:
                self.ctx.pins.append(record.pin)  # released at join, or when the run ends
        for branch in record.branches:
            branch.start(self.content.copy())

    def _join(self, node: Join) -> None:
        record = self.forks[node.fork_id]
        for branch in record.branches:
            branch.sync()
        names = {n for b in record.branches for n in b.variables}
        for name in sorted(names):  # both modes gather the branches' variables into lists
            self._define(
                name,
                [b.variables.get(name) for b in record.branches],
                {"branches": [b.meta.get(name) for b in record.branches]},
            )
        if node.mode == "concat":  # ... and concat also appends each branch's own part
            for branch in record.branches:
                self.content.append(
                    branch.content.text[record.text_len :], branch.content.ids[record.ids_len :]
                )
        for branch in record.branches:
            branch.close()
        if record.pin is not None:
            record.pin.release()

    def _define(self, name: str, value: Any, meta: dict[str, Any]) -> None:
        self.variables[name] = value
        self.meta[name] = meta
        self._events[name].set()
