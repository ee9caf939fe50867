"""Program branches the engine remembers between their requests, bounded per owner.

A program branch (GraphHints: program_id, branch_id) that finishes a request and will be back
is remembered until its next request arrives: as work ahead when it is back right away (its
`future_tokens` count against the pool when graph eviction defers admissions), or as a declared
return whose KV is prefetched from disk shortly before it (lookahead.py). Keys are owner-first:
program ids are the client's to choose, so one tenant's ids never touch another's branches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from runtime.cache.nodes import owner_of
from runtime.scheduler.request import Req

# branches remembered per owner (paused right away; declared returns): the oldest goes first, so
# a client naming a new program per request keeps at most this many (and their token ids)
MAX_BRANCHES_PER_OWNER = 256
MAX_BRANCHES = 4096  # ... and in all (without API keys owners are names clients choose)


def waits_on_return(req: Req) -> bool:
    """Whether `req`'s program goes on only once something outside it returns: its tools'
    calls (GraphHints.waits_on_tools, latency declared or not), or a declared return
    (GraphHints.next_turn_after_s: a tool's latency, a user's think time)."""
    hints = req.hints
    return hints.continuation and (hints.waits_on_tools or bool(hints.next_turn_after_s))


def future_tokens(req: Req, pool_slots: int) -> int:
    """What a request's program will still add to its sequence after it, if it is back right
    away (0 otherwise: a declared return, or one that waits on tools, is not work ahead); a
    hint of more than the pool holds counts as the pool."""
    right_away = req.hints.continuation and not waits_on_return(req)
    return min(req.hints.future_tokens or 0, pool_slots) if right_away else 0


def branch_key(req: Req) -> tuple:
    """A program branch, qualified by its owner, first (program ids are the client's to
    choose)."""
    return owner_of(req.namespace), req.hints.program_id, req.hints.branch_id


class BranchTable:
    """A branch key (branch_key: its owner first) -> an entry, at most
    MAX_BRANCHES_PER_OWNER per owner and MAX_BRANCHES in all: putting one more drops the
    owner's (or the table's) oldest."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple] = {}  # in insertion order: the oldest first
        self._by_owner: dict[Hashable, OrderedDict[tuple, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def put(self, key: tuple, entry: tuple) -> None:
        self.pop(key)
        keys = self._by_owner.get(key[0], {})
        while len(keys) >= MAX_BRANCHES_PER_OWNER:
            self.pop(next(iter(keys)))  # the owner's oldest
        if len(self._entries) >= MAX_BRANCHES:
            self.pop(next(iter(self._entries)))  # the table's oldest
        self._by_owner.setdefault(key[0], OrderedDict())[key] = None
        self._entries[key] = entry

    def pop(self, key: tuple) -> tuple | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            keys = self._by_owner[key[0]]
            del keys[key]
            if not keys:
                del self._by_owner[key[0]]
        return entry

    def get(self, key: tuple) -> tuple | None:
        return self._entries.get(key)

    def items(self) -> list[tuple[tuple, tuple]]:
        return list(self._entries.items())

    def values(self) -> list[tuple]:
        return list(self._entries.values())
