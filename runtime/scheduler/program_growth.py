"""How much a program is expected to grow after its first request: the room the program gate
(programs.py) keeps for the programs in to grow into (issue 52).

A program's footprint in the pool grows after its first request by what its later requests
compute and decode (tool results, answers, subagents; ProgramRecord counts it). How much is
learned from the latest GROWTHS_KEPT programs whose work ended, as a mean residual: one that
has grown g is expected to grow by as much more as those that grew past g did on average, and
by g again when none did. Short programs end first: a plain mean of those seen would tell a
long program in its later rounds that it is about done, and it then grows into the others'
kept paths. Before any program's work has ended, a program is expected to grow by as much as
its first request computed.

Only the growth no one knows ahead is reserved: a program whose first request waits on
something: its tools' calls (GraphHints.waits_on_tools, as flowlang sends it for a gen that offers
tools; how long, the slowest offered tool's latency_s, when declared), or a user's turn, when the
client tells the think time (GraphHints.next_turn_after_s). What comes back is then
known to no one, and the program goes on with it. A program whose next requests follow right
away (a chat's queued turns, a document's next questions; flowlang streams them as the program
runs, so a first request may not yet know it continues) reserves nothing, as before the
reserve, and its growth is not learned from: graph eviction keeps what its queued requests will
read. Reserving it too made such programs compute more than with no reserve (W6 in rounds at a
25% pool: 23,884 tokens against 22,843 in three runs each; RESULTS.md, "The growth still due
reserved, by rank").

Without a reserve for it, every agent of a batch enters at once (their first prompts fit) and
their later turns evict each other's paths: at 20 agents on a 35% pool all 20 were in within
35 s and 38 paths were lost in the next 90 s (RESULTS.md, "The growth still due reserved").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from runtime.scheduler.branches import waits_on_return

if TYPE_CHECKING:
    from runtime.scheduler.program_service import ProgramRecord
    from runtime.scheduler.request import Req

GROWTHS_KEPT = 64  # programs whose growth the expected growth is learned from (the latest)


class ProgramGrowth:
    """The growths seen, and the growth still due to programs (see the module docstring)."""

    def __init__(self, pool_slots: int) -> None:
        self.pool_slots = pool_slots
        # how much programs grew after their first request, the latest whose work ended
        self.seen: deque[int] = deque(maxlen=GROWTHS_KEPT)

    def ended(self, record: ProgramRecord) -> None:
        """`record`'s program's work ended: learn how much it grew (if that was unknown)."""
        unknown = record.growth_unknown
        grown = record.growth_ended()
        if unknown:
            self.seen.append(grown)

    def mean_tokens(self) -> float:
        """How much the programs whose work ended grew, on average (0 before any has)."""
        return sum(self.seen) / len(self.seen) if self.seen else 0.0

    def due_with(
        self, req: Req, record: ProgramRecord | None, takes_tokens: int,
        peers: Iterable[ProgramRecord],
    ) -> float:  # fmt: skip
        """The growth still due to `req`'s program (`record`, None if it has none yet) and to
        the programs `peers` (ProgramRecord.growth_due). One that has not started is expected
        to grow by as much as the programs whose work ended did on average, or before any has,
        by as much as its prompt (by nothing when its growth is not unknown). Its own is at
        most what the pool holds beside the `takes_tokens` it takes (alone it always fits: it
        grows past the pool anyway)."""
        if record is not None and record.first_tokens is not None:
            own = record.growth_due(self.seen)
        elif not waits_on_return(req):  # (what it grows by is known ahead: nothing reserved)
            own = 0.0
        else:
            own = self.mean_tokens() if self.seen else req.num_tokens
        own = min(own, max(0, self.pool_slots - takes_tokens))
        return own + sum(r.growth_due(self.seen) for r in peers)
