"""RequestGraph: a program traced without running (`program.compile`), printed and measured.

`flowlang.tracing` builds it; the prompts of requests whose prompt holds a generated value are
unknown (dynamic), and a trace that stopped early says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flowlang.ir import Fork, Gen, Join, Node, RoleBegin, RoleEnd, Select, Text
from runtime.prefix import kv_bytes_per_token_of, union_prefix_tokens


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

    def to_svg(self) -> str:
        """The graph as a picture (SVG): boxes for text, gen, select, fork and join, shared
        prefixes tinted, prompt sizes in tokens."""
        from flowlang.picture import graph_svg  # picture.py draws graphs: it imports this one

        return graph_svg(self)

    def _repr_svg_(self) -> str:  # Jupyter
        return self.to_svg()

    def static_prompts(self) -> list[tuple[int, ...]]:
        """The prompt ids of every request whose prompt is known before running."""
        return [r.prompt_ids for r in self.requests if r.prompt_ids is not None]

    def first_prompt(self) -> tuple[int, ...] | None:
        """The first request's prompt ids (None: no request, or a dynamic prompt)."""
        return self.requests[0].prompt_ids if self.requests else None

    def prefix_report(self, model_config: Any, others: Sequence[RequestGraph] = ()) -> PrefixReport:
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
            kv_bytes_per_token_of(model_config),
        )


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
