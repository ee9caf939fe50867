"""Program homes: the replica each program's turns last ran on, so the router keeps a program
together (issue 52, item 5).

An agent's turns extend one another's prompts, and its replica knows the program: its kept KV
across a tool call, what its tools took before, the service it has had (the program gate,
runtime/scheduler/programs.py). The cache-aware rule already follows a cached prefix; a home
also holds a program where that rule would otherwise scatter it — its prefix evicted on every
replica (least loaded would decide), or costs within a few tokens of each other (events in
flight). The program moves only when another replica is cheaper by more than
`RouterConfig.program_move_tokens` (its home's pool is full of others' KV, or the load guard
leaves its home out). vLLM's agent-trace study found session-sticky routing ahead of every
load-balancing policy; ours stays cost-aware.

Bounded: at most MAX_HOMES programs, the least recently routed forgotten first (a forgotten
program is routed afresh, as a new one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

MAX_HOMES = 4096


class ProgramHomes:
    """program key -> replica id, least recently routed first.

    >>> homes = ProgramHomes(max_homes=2)
    >>> homes.record("p", "r0"); homes.record("q", "r1"); homes.record("p", "r1")
    >>> homes.home("p"), homes.moves
    ('r1', 1)
    >>> homes.record("s", "r0"); homes.home("q") is None  # the least recently routed went
    True
    """

    def __init__(self, max_homes: int = MAX_HOMES) -> None:
        self.max_homes = max_homes
        self._homes: OrderedDict[Hashable, Hashable] = OrderedDict()
        self.moves = 0  # turns routed away from their program's home

    def __len__(self) -> int:
        return len(self._homes)

    def home(self, program: Hashable) -> Hashable | None:
        """Where the program last ran (None: new, or forgotten)."""
        return self._homes.get(program)

    def record(self, program: Hashable, replica_id: Hashable) -> None:
        """The program's turn was routed to `replica_id`: that is its home now."""
        previous = self._homes.pop(program, None)
        if previous is not None and previous != replica_id:
            self.moves += 1
        self._homes[program] = replica_id
        while len(self._homes) > self.max_homes:
            self._homes.popitem(last=False)

    def drop_replica(self, replica_id: Hashable) -> None:
        """A replica left: its programs have no home (their KV went with it)."""
        for program in [p for p, r in self._homes.items() if r == replica_id]:
            del self._homes[program]
