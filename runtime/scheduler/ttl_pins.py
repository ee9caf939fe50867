"""A fixed time-to-live pin at tool calls (Continuum's rule; `tool_pin_ttl_s`): a baseline the
program gate (programs.py) is measured against, and a setting for whoever wants it.

A request of a program (GraphHints.program_id) that ends on a continuation waiting on its tools
(GraphHints.waits_on_tools, or a declared return: its branch waits on their calls) keeps its path
locked for `tool_pin_ttl_s` seconds after it finishes, so nothing evicts it while the tools run.
The pin goes when the branch's next request arrives (it locks the path itself) or when the time
is up, whichever is first. A pin holds memory whoever waits for it: under pressure, requests that do
not fit beside the pins wait or fail as busy.
`NoTtlPins` is the rule turned off (the default).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

from runtime.scheduler.branches import branch_key, waits_on_return
from runtime.scheduler.request import Req

if TYPE_CHECKING:
    from runtime.cache.base import PrefixCache
    from runtime.cache.nodes import TreePosition


class TtlPins:
    """Branch key -> its pinned path, unpinned on return or at expiry."""

    def __init__(self, cache: PrefixCache, ttl_s: float) -> None:
        self.cache = cache
        self.ttl_s = ttl_s
        self._pinned: dict[tuple, tuple[int, TreePosition]] = {}  # branch -> (seq, position)
        self._expiry: list[tuple[float, int, tuple]] = []  # heap: (expiry s, seq, branch)
        self._seq = itertools.count()

    def paused(self, req: Req, position: TreePosition, now_s: float) -> None:
        """`req` finished locked at `position`; pin it if its branch waits on its tools or a
        declared return."""
        if not waits_on_return(req):
            return
        key = branch_key(req)
        self.unpin(key)
        self.cache.lock(position)
        seq = next(self._seq)
        self._pinned[key] = (seq, position)
        heapq.heappush(self._expiry, (now_s + self.ttl_s, seq, key))

    def arrived(self, req: Req) -> None:
        self.unpin(branch_key(req))

    def advance(self, now_s: float) -> None:
        while self._expiry and self._expiry[0][0] <= now_s:
            _, seq, key = heapq.heappop(self._expiry)
            if self._pinned.get(key, (None,))[0] == seq:
                self.unpin(key)

    def unpin(self, key: tuple) -> None:
        entry = self._pinned.pop(key, None)
        if entry is not None:
            self.cache.unlock(entry[1])

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)


class NoTtlPins:
    """No pins at tool calls: nothing to do at any event."""

    num_pinned = 0

    def paused(self, req: Req, position: TreePosition, now_s: float) -> None: ...

    def arrived(self, req: Req) -> None: ...

    def advance(self, now_s: float) -> None: ...
