"""ForkRecord: what a fork shares with its branches until the join (the prefix's pin).

The shared prefix is pinned lazily, by the first branch that sends a request, and an outer
fork's prefix before an inner one's: the inner prefix extends the outer, so its pin finds the
outer one cached instead of computing it again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flowlang.backends.base import PinLease
from flowlang.context import RunContext
from flowlang.telemetry import pin_span
from runtime.protocol import GraphHints

if TYPE_CHECKING:
    from flowlang.executor import StreamExecutor


@dataclass
class ForkRecord:
    """A fork in flight: its branches, and the shared prefix they extend (pinned once)."""

    branches: list[StreamExecutor]
    upstream: ForkRecord | None  # the fork whose branch forked this one
    pin: PinLease | None = None
    text_len: int = 0  # the parent's content when it forked: where branches' own parts start
    ids_len: int = 0
    # the shared prefix, pinned when a branch first sends a request: a fork whose branches only
    # append text before the join would pin KV that nothing reads before the join's prompt
    prefix: tuple[list[int], GraphHints] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ensure_pinned(self, ctx: RunContext) -> None:
        """Prefill the shared prefix once (outer forks' first) and lock it until the join."""
        with self.lock:
            if self.prefix is None:
                return
            if self.upstream is not None:
                self.upstream.ensure_pinned(ctx)
            ids, hints = self.prefix
            self.prefix = None
            # an engine without a prefix cache answers at once, computing and holding nothing
            with pin_span(len(ids)):  # under the step whose request needed it
                self.pin = ctx.backend.pin(ids, ctx.namespace, hints)
            with ctx.lock:
                ctx.pins.append(self.pin)  # released at join, or when the run ends
