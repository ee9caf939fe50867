"""StreamExecutor: runs one state's IR nodes in order on a worker thread.

The program thread only appends nodes (so it runs ahead and exposes future work); reading a
variable waits for the node that defines it. This is the one place that runs nodes.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from flowlang.content import Content, Renderer
from flowlang.context import RunContext
from flowlang.errors import (
    ExecutionError,
    FlowlangError,
    InvalidOutputError,
    ProgramError,
    UnknownVariableError,
)
from flowlang.feed import TextFeed
from flowlang.forks import ForkRecord
from flowlang.ir import Fork, Gen, Join, Node, RoleBegin, RoleEnd, Select, Text
from flowlang.rendezvous import END, Rendezvous
from flowlang.results import appended_ids, gen_meta, output_format, read_output
from flowlang.selection import score_choices
from flowlang.telemetry import (
    branch_span,
    gen_request_attributes,
    gen_result_attributes,
    select_attributes,
    step_span,
)
from runtime.protocol import GenerateRequest, GraphHints, SamplingParams
from runtime.telemetry import NULL_SPAN

_END = object()
_REQUEST_NODES = (Gen, Select, Fork)  # nodes that send the engine a request on this sequence
ROLE_MARKER_TOKENS = 4  # a chat template's role header or end, about (future_tokens)


class StreamExecutor:
    """Runs the nodes of one state (the root or a fork branch) on its own worker thread."""

    def __init__(
        self,
        ctx: RunContext,
        branch_id: str = "0",
        fork_group: tuple[str, int] | None = None,
        upstream: ForkRecord | None = None,
    ) -> None:
        self.ctx = ctx
        self.program_id = ctx.program_id
        self.branch_id = branch_id
        self.fork_group = fork_group
        self.upstream = upstream  # the fork this state is a branch of (its prefix's pin)
        self.renderer = Renderer(ctx.backend)
        self.content = Content()
        # where reads wait for the worker's definitions (and a gen's deltas are streamed)
        self.rendezvous = Rendezvous()
        self.variables = self.rendezvous.values
        self.metadata = self.rendezvous.metadata
        self.declared: set[str] = set()
        self.feed = TextFeed()  # everything appended, for `s.text_iter()`
        self.forks: dict[str, ForkRecord] = {}
        self.error: BaseException | None = None
        # what its steps' spans nest under: the run's, or (a fork branch) its own, which is
        # ended when the branch closes (flowlang/telemetry.py; NULL_SPAN with tracing off)
        self.span: Any = ctx.span
        self._branch_span: Any = NULL_SPAN
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._num_queued_requests = 0  # gen/select/fork nodes submitted and not yet run
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
            self.feed.put(content.text)
        self._started.set()

    def trace_under(self, parent: Any, fork: Fork) -> None:
        """A branch's steps nest under a span of its own, child of `parent` (the span of the
        state that forked it), ended when the branch closes."""
        self._branch_span = branch_span(parent, self.branch_id, fork.fork_id, fork.num_branches)
        self.span = self._branch_span

    def submit(self, node: Node) -> None:
        """Queue a node for the worker; returns at once."""
        if isinstance(node, Gen | Select) and node.name is not None:
            self.declared.add(node.name)
            self.rendezvous.promise(node.name)
            if isinstance(node, Gen) and node.reasoning_var is not None:
                self.declared.add(node.reasoning_var)
                self.rendezvous.promise(node.reasoning_var)
        elif isinstance(node, Join):  # its gathered variables can be read right after the join
            gathered = set().union(*(b.declared for b in self.forks[node.fork_id].branches))
            self.declared |= gathered
            for name in gathered:
                self.rendezvous.promise(name)
        with self._idle:
            self._pending += 1
            self._num_queued_requests += isinstance(node, _REQUEST_NODES)
        self._queue.put(node)

    def fork(self, num_branches: int) -> tuple[str, list[StreamExecutor]]:
        """Queue a fork; its branches start from this state's content when the worker gets there."""
        fork_id = self.ctx.next_fork_id()
        record = ForkRecord([], self.upstream)
        record.branches = [
            StreamExecutor(self.ctx, f"{self.branch_id}.{i}", (fork_id, num_branches), record)
            for i in range(num_branches)
        ]
        self.forks[fork_id] = record
        self.submit(Fork(fork_id, num_branches))
        return fork_id, record.branches

    def get(self, name: str) -> Any:
        """The value of variable `name`, waiting for the node that defines it."""
        if name not in self.declared and name not in self.variables:
            known = sorted(self.declared | set(self.variables))
            raise UnknownVariableError(
                f"no gen/select defines {name!r} in this state; defined: {known}"
            )
        return self.rendezvous.wait(name)

    def set(self, name: str, value: Any, meta: dict[str, Any] | None = None) -> None:
        """Define variable `name` now (readers waiting for it get `value`)."""
        self.declared.add(name)
        self.rendezvous.promise(name)
        self._define(name, value, meta or {})

    def meta(self, name: str) -> dict[str, Any]:
        """What the node that defined `name` reported, once it ran."""
        self.get(name)
        return self.metadata[name]

    def stream(self, name: str | None) -> Iterator[str]:
        """The text deltas of gen `name` as the backend produces them; with no name, all the
        text this state appends (ends when the state's program ends)."""
        if name is None:
            yield from self.feed
            return
        if name not in self.declared:
            self.get(name)  # raises the clear unknown-variable error
        deltas = self.rendezvous.deltas(name)
        while (delta := deltas.get()) is not END:
            yield delta
        deltas.put(END)  # a later iteration ends too

    def settle(self, reading: str) -> tuple[Content, dict[str, Any]]:
        """Content and variables once every submitted node ran (`reading` is for tracing)."""
        self.sync()
        return self.content, self.variables

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
        """End the worker once it has run what is queued."""
        self._started.set()
        self._queue.put(_END)
        self._branch_span.end()  # after its join (or the run's end): its work is done

    def wake_all(self) -> None:
        """Unblock readers and let the queue drain (after a failure in the run)."""
        self._started.set()
        self.rendezvous.fail(self.error or self.ctx.error)

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
                    self._num_queued_requests -= isinstance(node, _REQUEST_NODES)
                    self._idle.notify_all()
        self.feed.close()

    def _execute(self, node: Node) -> None:
        if isinstance(node, Text | RoleBegin | RoleEnd):
            start = len(self.content.text)
            self.renderer.apply(self.content, node)
            self.feed.put(self.content.text[start:])
        elif isinstance(node, Gen):
            with step_span(self.span, "gen", node.name, self.branch_id) as span:
                self._gen(node, span)
        elif isinstance(node, Select):
            with step_span(self.span, "select", node.name, self.branch_id) as span:
                self._select(node, span)
        elif isinstance(node, Fork):
            self._fork(node)
        elif isinstance(node, Join):
            with step_span(self.span, "join", None, self.branch_id) as span:
                span.set_attributes({"flowlang.fork.id": node.fork_id})
                self._join(node)
        else:
            raise ProgramError(f"unknown node {node!r}")

    def _hints(
        self, next_turn_after_s: float | None = None, waits_on_tools: bool = False
    ) -> GraphHints:
        group_id, group_size = self.fork_group or (None, None)
        # a gen with tools pauses this branch until its calls return: the program goes on
        # extending this sequence once they have run, whatever it has queued so far
        continuation = waits_on_tools or self._num_queued_requests > 1
        return GraphHints(
            program_id=self.ctx.program_id,
            branch_id=self.branch_id,
            fork_group_id=group_id,
            fork_group_size=group_size,
            priority=self.ctx.priority,
            # another request of this state is queued behind the running one: it will extend
            # this sequence (trailing text such as a role's end is no request: no continuation)
            continuation=continuation,
            next_turn_after_s=next_turn_after_s if continuation else None,
            waits_on_tools=waits_on_tools,  # (its calls' latency known or not)
            future_tokens=self._future_tokens() if continuation else None,
        )

    def _future_tokens(self) -> int:
        """About how many tokens the requests queued after this one add to this sequence:
        their text (at this sequence's tokens per character so far, a few tokens per role
        marker) and outputs, up to a fork. Nothing is tokenized ahead of time."""
        with self._queue.mutex:
            queued = list(self._queue.queue)
        tokens_per_char = len(self.content.ids) / max(1, len(self.content.text))
        chars = tokens = 0
        for node in queued:
            if isinstance(node, Text):
                chars += len(node.text)
            elif isinstance(node, RoleBegin | RoleEnd):
                tokens += ROLE_MARKER_TOKENS
            elif isinstance(node, Gen):
                tokens += node.params.max_new_tokens
            elif isinstance(node, Fork):
                break  # branches grow their own sequences
        return tokens + round(chars * tokens_per_char)

    def _params(self, node: Gen) -> SamplingParams:
        """The gen's own settings over the run-level defaults (SGLang's `run(temperature=...)`)."""
        if self.ctx.sampling is None:
            return node.params
        own = node.params.model_dump(include=node.params.model_fields_set)
        try:
            return SamplingParams(**{**self.ctx.sampling.model_dump(), **own})
        except ValueError as err:
            raise ProgramError(f"gen({node.name!r}) with the run's sampling: {err}") from err

    def _gen(self, node: Gen, span: Any) -> None:
        if not self.content.ids:
            raise ProgramError(f"gen({node.name!r}) needs a prompt: add text first")
        if self.upstream is not None:
            self.upstream.ensure_pinned(self.ctx)
        fmt = output_format(node, self.ctx.backend, self.content.text)
        waits_on_tools = bool(node.tools) and node.tool_choice != "none"
        next_turn_after_s = node.next_turn_after_s
        if next_turn_after_s is None and waits_on_tools:  # the slowest tool it may call
            next_turn_after_s = max(
                (t.latency_s for t in node.tools if t.latency_s is not None), default=None
            )
        request = GenerateRequest(
            input_ids=list(self.content.ids),
            sampling=self._params(node),
            constraint=fmt.constraint,
            hints=self._hints(next_turn_after_s, waits_on_tools),
            namespace=self.ctx.namespace,
        )
        span.set_attributes(gen_request_attributes(request, self.ctx.backend))
        handle = self.ctx.backend.generate(request)
        stream = self.rendezvous.deltas(node.name) if node.name is not None else queue.Queue()
        streamed = ""
        for delta in handle:
            stream.put(delta)
            self.feed.put(delta)
            streamed += delta
        result = handle.result()
        stream.put(END)
        span.set_attributes(gen_result_attributes(result))
        if result.finish_reason == "error":
            raise ExecutionError(f"gen({node.name!r}) failed: {result.error}")
        if result.text.startswith(streamed):  # the deltas fed so far, and what they held back
            self.feed.put(result.text[len(streamed) :])
        self.content.append(result.text, appended_ids(result, self.ctx.backend))
        meta = gen_meta(result)
        try:
            value = read_output(node, fmt, result, meta, self.content.num_calls)
        except InvalidOutputError:
            if node.name is not None:
                self.metadata[node.name] = meta  # the raw output stays inspectable
            raise
        self.content.num_calls += len(meta.get("tool_calls", ()))
        if node.reasoning_var is not None:
            self._define(node.reasoning_var, meta.get("reasoning"), meta)
        self._define(node.name, value, meta)

    def _select(self, node: Select, span: Any) -> None:
        if not self.content.ids:
            raise ProgramError(f"select({node.name!r}) needs a prompt: add text first")
        if self.upstream is not None:
            self.upstream.ensure_pinned(self.ctx)
        choice_ids, decision, meta = score_choices(
            self.ctx.backend, self.content, node, self._hints(), self.ctx.namespace
        )
        chosen = node.choices[decision.index]
        span.set_attributes(select_attributes(len(node.choices), decision.index))
        self.content.append(chosen, choice_ids[decision.index])
        self.feed.put(chosen)
        self._define(node.name, chosen, meta)

    def _fork(self, node: Fork) -> None:
        record = self.forks[node.fork_id]
        record.text_len, record.ids_len = len(self.content.text), len(self.content.ids)
        if len(self.content.ids) > 0:
            # prefilled once and locked while the branches run, from their first request on
            record.prefix = (list(self.content.ids), self._hints())
        for branch in record.branches:
            branch.trace_under(self.span, node)
            branch.start(self.content.copy())

    def _join(self, node: Join) -> None:
        record = self.forks[node.fork_id]
        for branch in record.branches:
            branch.sync()
        names = {n for b in record.branches for n in (*b.variables, *b.declared)}
        for name in sorted(names):  # both modes gather the branches' variables into lists
            self._define(
                name,
                [b.variables.get(name) for b in record.branches],
                {"branches": [b.metadata.get(name) for b in record.branches]},
            )
        if node.mode == "concat":  # ... and concat also appends each branch's own part
            for branch in record.branches:
                part = branch.content.text[record.text_len :]
                self.content.append(part, branch.content.ids[record.ids_len :])
                self.feed.put(part)
        for branch in record.branches:
            branch.close()
        with record.lock:
            record.prefix = None  # (never pinned: no branch sent a request)
        if record.pin is not None:
            record.pin.release()

    def _define(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:  # an anonymous gen/select: its text is appended, nothing is kept
            return
        self.rendezvous.publish(name, value, meta)
