"""RequestGraph: a program traced without running (`program.compile`), printed and measured.

Generated values are placeholders while tracing; reading one (control flow that depends on a
generation) ends the static part, and the graph says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flowlang.backends.base import Backend
from flowlang.content import Content, Renderer
from flowlang.errors import ProgramError
from flowlang.ir import Fork, Gen, Join, Node, RoleBegin, RoleEnd, Select, Text
from flowlang.prefix import union_prefix_tokens
from flowlang.primitives import to_nodes


@dataclass(frozen=True)
class Branches:
    fork: Fork
    streams: tuple[Stream, ...]


@dataclass(frozen=True)
class Stream:
    items: tuple[Node | Branches, ...]


@dataclass(frozen=True)
class RequestInfo:
    kind: str  # "gen" | "select"
    name: str
    branch: str
    prompt_ids: tuple[int, ...] | None  # None: the prompt contains a generated value


@dataclass(frozen=True)
class PrefixReport:
    num_requests: int
    num_dynamic: int
    total_tokens: int
    unique_tokens: int
    kv_bytes_per_token: int

    @property
    def saved_tokens(self) -> int:
        return self.total_tokens - self.unique_tokens

    @property
    def bytes_saved(self) -> int:
        return self.saved_tokens * self.kv_bytes_per_token

    def __str__(self) -> str:
        return (
            f"{self.num_requests} requests with static prompts ({self.num_dynamic} more depend"
            f" on generated text): {self.total_tokens:,} prompt tokens in all, "
            f"{self.unique_tokens:,} unique in the prefix tree; KV {self.kv_bytes_per_token:,}"
            f" B/token, {self.bytes_saved / 2**20:,.0f} MiB and {self.saved_tokens:,} "
            f"prefill tokens saved"
        )


@dataclass(frozen=True)
class RequestGraph:
    """The frozen IR of one program instance, with the prompts of its static requests."""

    program: str
    root: Stream
    requests: tuple[RequestInfo, ...]
    partial_reason: str | None = None  # why tracing stopped early, if it did

    def dump(self) -> str:
        """Readable text: one IR node a line, branches indented."""
        lines = [
            f"program {self.program}"
            + (f"  (static part only: {self.partial_reason})" if self.partial_reason else "")
        ]
        _dump_stream(self.root, 1, lines)
        for request in self.requests:
            size = (
                "dynamic prompt"
                if request.prompt_ids is None
                else f"prompt {len(request.prompt_ids)} tokens"
            )
            lines.append(f"request {request.kind} {request.name} @ branch {request.branch}: {size}")
        return "\n".join(lines)

    def static_prompts(self) -> list[tuple[int, ...]]:
        return [r.prompt_ids for r in self.requests if r.prompt_ids is not None]

    def first_prompt(self) -> tuple[int, ...] | None:
        return self.requests[0].prompt_ids if self.requests else None

    def prefix_report(self, model_config: Any, others: list[RequestGraph] = ()) -> PrefixReport:
        """Total vs unique prompt tokens of the static requests (of this graph and `others`)
        and the KV memory the shared prefixes save for `model_config`."""
        graphs = [self, *others]
        prompts = [p for g in graphs for p in g.static_prompts()]
        dynamic = sum(1 for g in graphs for r in g.requests if r.prompt_ids is None)
        return PrefixReport(
            len(prompts),
            dynamic,
            sum(map(len, prompts)),
            union_prefix_tokens(prompts),
            kv_bytes_per_token(model_config),
        )


def kv_bytes_per_token(model_config: Any) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, from a transformers config
    (or a dict with the same keys)."""
    get = (
        model_config.get
        if isinstance(model_config, dict)
        else (lambda key, default=None: getattr(model_config, key, default))
    )
    layers = get("num_hidden_layers")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or get("hidden_size") // heads
    dtype = str(get("torch_dtype") or get("dtype") or "float32").replace("torch.", "")
    element = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}[dtype]
    return 2 * layers * kv_heads * head_dim * element


# ---------------------------------------------------------------------- tracing
class _StopTracing(Exception):
    """Raised when a traced program reads a generated value."""


class TraceState:
    """Records what a program appends; generated values are unknown while tracing."""

    def __init__(self, tracer: Tracer, branch: str) -> None:
        self._tracer = tracer
        self._items: list[Node | Branches] = []
        self._branch = branch
        self._forks: dict[str, list[TraceState]] = {}
        self._joined: set[str] = set()
        self._fork_id: str | None = None

    def __iadd__(self, other: Any) -> TraceState:
        self._items.extend(to_nodes(other))
        return self

    @contextlib.contextmanager
    def role(self, name: str) -> Iterator[TraceState]:
        self._items.append(RoleBegin(name))
        try:
            yield self
        finally:
            self._items.append(RoleEnd(name))

    def system(self):
        return self.role("system")

    def user(self):
        return self.role("user")

    def assistant(self):
        return self.role("assistant")

    def fork(self, num_branches: int) -> list[TraceState]:
        if not isinstance(num_branches, int) or num_branches < 1:
            raise ProgramError(f"fork() needs a positive number of branches, got {num_branches!r}")
        self._tracer.num_forks += 1
        fork = Fork(f"f{self._tracer.num_forks}", num_branches)
        branches = [TraceState(self._tracer, f"{self._branch}.{i}") for i in range(num_branches)]
        for b in branches:
            b._fork_id = fork.fork_id
        self._forks[fork.fork_id] = branches
        self._items.append(_PendingBranches(fork, branches))
        return branches

    def join(self, branches: list[TraceState], mode: str = "gather") -> None:
        fork_id = branches[0]._fork_id if branches else None
        if fork_id not in self._forks or fork_id in self._joined:
            raise ProgramError("join() takes the branches of one fork() of this state, once")
        self._joined.add(fork_id)
        self._items.append(Join(fork_id, mode))

    def __getitem__(self, name: str) -> Any:
        raise _StopTracing(f"the program reads {name!r}, a generated value")

    def aget(self, name: str) -> Any:
        raise _StopTracing(f"the program reads {name!r}, a generated value")

    def get(self, name: str, default: Any = None) -> Any:
        return self[name]

    def text(self) -> str:
        raise _StopTracing("the program reads its text")

    def messages(self) -> list:
        raise _StopTracing("the program reads its messages")

    def meta(self, name: str) -> dict:
        raise _StopTracing(f"the program reads meta of {name!r}")

    def sync(self) -> TraceState:
        return self

    def stream(self) -> Stream:
        items = tuple(
            Branches(i.fork, tuple(b.stream() for b in i.branches))
            if isinstance(i, _PendingBranches)
            else i
            for i in self._items
        )
        return Stream(items)


@dataclass
class _PendingBranches:
    fork: Fork
    branches: list[TraceState]


@dataclass
class Tracer:
    num_forks: int = 0


@dataclass
class _Simulation:
    renderer: Renderer
    requests: list[RequestInfo] = field(default_factory=list)

    def run(self, stream: Stream, content: Content, dynamic: bool, branch: str) -> None:
        for item in stream.items:
            if isinstance(item, Branches):
                for i, sub in enumerate(item.streams):
                    self.run(sub, content.copy(), dynamic, f"{branch}.{i}")
            elif isinstance(item, Text | RoleBegin | RoleEnd):
                self.renderer.apply(content, item)
            elif isinstance(item, Gen | Select):
                prompt = None if dynamic else tuple(content.ids)
                kind = "gen" if isinstance(item, Gen) else "select"
                self.requests.append(RequestInfo(kind, item.name, branch, prompt))
                dynamic = True  # what follows contains a generated value


def trace(program_name: str, fn, backend: Backend, args: tuple, kwargs: dict) -> RequestGraph:
    tracer = Tracer()
    state = TraceState(tracer, "0")
    reason = None
    try:
        result = fn(state, *args, **kwargs)
        if hasattr(result, "__await__"):
            result.close()
            reason = "async programs are traced up to their first await"
    except _StopTracing as stop:
        reason = str(stop)
    root = state.stream()
    simulation = _Simulation(Renderer(backend))
    simulation.run(root, Content(), False, "0")
    return RequestGraph(program_name, root, tuple(simulation.requests), reason)


def _dump_stream(stream: Stream, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for item in stream.items:
        if isinstance(item, Branches):
            lines.append(f"{pad}fork {item.fork.fork_id} x{item.fork.num_branches}")
            for i, sub in enumerate(item.streams):
                lines.append(f"{pad}  branch {i}:")
                _dump_stream(sub, depth + 2, lines)
        elif isinstance(item, Text):
            preview = item.text if len(item.text) <= 48 else item.text[:45] + "..."
            lines.append(f"{pad}text {preview!r} ({len(item.text)} chars)")
        elif isinstance(item, RoleBegin):
            lines.append(f"{pad}<{item.role}>")
        elif isinstance(item, RoleEnd):
            lines.append(f"{pad}</{item.role}>")
        elif isinstance(item, Gen):
            p = item.params
            lines.append(
                f"{pad}gen {item.name} (max_new_tokens={p.max_new_tokens}, "
                f"temperature={p.temperature}" + (f", stop={p.stop}" if p.stop else "") + ")"
            )
        elif isinstance(item, Select):
            lines.append(f"{pad}select {item.name} {list(item.choices)} ({item.method})")
        elif isinstance(item, Join):
            lines.append(f"{pad}join {item.fork_id} ({item.mode})")
