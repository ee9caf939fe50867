"""Programs as the unit of admission: a program's KV is kept across its tool calls, and a new
program starts only when the pool holds it beside the programs already in (issue 52, item 2).

Requests name their program (GraphHints.program_id; over HTTP a session id). A program is *in*
while one of its requests runs, or one of its branches paused on a continuation (a tool call, a
next turn) and the path it paused at is still in the pool: that path is the program's *kept*
KV. Graph eviction ranks kept paths after everything no one will read (a finished program's
KV goes first, the farthest return of the paused first after that). A request of a program
that is not in (its first, or one whose kept path was evicted meanwhile) enters only if the
slots it needs fit beside every kept path and a headroom for the programs in to grow into:
the programs in keep their working sets instead of every program thrashing every other's.
Without the gate, agents at a 35% pool compute 3x the exact bound (RESULTS.md,
agent_trace_bench.py). The headroom is the growth still due, and a learned part:
- Growth: what the programs are expected to grow by after their first request, less what they
  grew already (program_growth.py). An entrant leaves room for its own expected growth and for
  what each program in that it does not outrank (below) has still to grow.
- Learned: a kept path lost to eviction (the programs in outgrew the pool) adds its length,
  each entry takes HEADROOM_DECAY of it off.
With a lower tier (host memory, disk) an evicted path is loaded back, not recomputed: its
program stays in.

Which waiting program enters first: higher GraphHints.priority, then least attained service
(tokens computed for the program so far along its longest path; Autellix's PLAS and ATLAS,
program_service.py), then the oldest; one that has waited STARVATION_S enters before any that
has not. Programs enter in that order: the first that does not fit holds the rest, so a large
program is not passed forever by small ones.

Programs in do not keep their KV against every newcomer (else a program that arrives while the
pool is full waits for long ones to end: first come, first served by program). A program's *rank*
is its GraphHints.priority, then its service level (less attained service first; levels double
from an eighth of the pool, Autellix's discretized PLAS queues, program_service.service_level).
A waiting program leaves no room for the growth of the programs in that it outranks (it is
served before their growth), and one that outranks every program in leaves no headroom at all.
One that outranks paused programs in *displaces* them, the lowest first, as many as free the
room it lacks beside the other kept paths and the learned headroom; one that lacks room only
for the growth still due displaces none (it waits). Reserving the growth due whatever the rank,
and displacing for it, made each newcomer of a document batch (a service level above the
programs in) displace a paused program, and the displaced recomputed their documents
(RESULTS.md, "The growth still due reserved"). The displaced programs' paths are no longer kept
(the part only they hold goes first when the pool needs room), and their next requests enter in
order. Within a rank none displaces another, so programs of about the same service do not take
the pool from each other in turns. Displacing is priced by ski rental: the newcomer displaces
once it has waited as long as recomputing what it frees takes.
The same rank orders compute: while a request of the best rank running runs, the prompts of
those ranked below go in short steps (step_ranks.py).

Waiting is priced, with the engine's measured step costs (StepTime: a step is t0 + c per token).
When nothing runs and every program in is paused on its tools, a waiting program enters anyway
if recomputing the kept KV it would evict (c per token) costs less than waiting for the soonest
expected return. A return is expected when it was declared (GraphHints.next_turn_after_s:
flowlang sends the slowest offered tool's latency_s) until returns after that declaration have
been seen: then after the gap they took. Tools that declare no latency (GraphHints.waits_on_tools
alone) are expected back at once until their returns are seen, learned apart from requests that
continue right away. And whether others run or not, a waiting program enters
once the engine has sat idle since it arrived for as long as recomputing what it evicts would
take (ski rental, `idled_past_recompute`): on the tiny model the engine idles about half the
time while programs wait on tools and clients, and a program held out of an idle engine was the
gate's loss against lru there; where compute is the bottleneck the engine does not idle and the
program waits. While others run and the engine is busy, a program that does not fit waits: a
price that let it in to share the running steps' fixed cost (t0 for each token it would decode)
was tried and removed. It weighed one request's decodes against the KV evicted now, but the
entrant grows into the pool over its later turns and the kept paths it then evicts were not
priced. Side by side without it, the gate computed less in 7 of 8 tiny cells with makespans
level, 1.25x the bound instead of 1.38x on 20 agents with the default model (its mean 4% longer
in that run), and 68,851 tokens instead of 80,666 on W1 in rounds at a 50% pool in about the same
wall time (RESULTS.md, "The joining price removed").

`NoPrograms` is the gate turned off (`program_admission=False`, or eviction that knows no
future): every request is its own program and nothing is held.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, NamedTuple

from runtime.cache.graph_policy import CONTINUATION_GRACE_S
from runtime.cache.nodes import owner_of, private_path
from runtime.protocol import MAX_HINT_RETURN_S
from runtime.scheduler.branches import MAX_BRANCHES, BranchTable, branch_key, waits_on_return
from runtime.scheduler.program_growth import ProgramGrowth
from runtime.scheduler.program_service import (
    MAX_PROGRAM_BRANCHES,
    TRUNK,
    ProgramRecord,
    service_level,
)
from runtime.scheduler.request import Req
from runtime.scheduler.step_time import IdleTime, StepTime

if TYPE_CHECKING:
    from runtime.cache.nodes import TreeNode, TreePosition
    from runtime.scheduler.kv import KVManager

STARVATION_S = 60.0  # a request waiting this long to enter goes before every one that has not
# a paused program this late past its expected return is not waited for (it is still kept
# until CONTINUATION_GRACE_S: a program whose tool ran long finds its KV)
LATE_S = 1.0
HEADROOM_DECAY = 0.1
# a service level's quantum (program_service.service_level), as a share of the pool
SERVICE_QUANTUM_SHARE = 1 / 8
GAP_DECAY = 0.2  # each return seen moves the learned gap this far towards it


def program_key(req: Req) -> tuple[Hashable, str] | None:
    """(owner, program id), or None for a request that names no program."""
    program_id = req.hints.program_id
    return None if program_id is None else (owner_of(req.namespace), program_id)


class Paused(NamedTuple):
    """A branch paused on a continuation."""

    node: TreeNode  # where its path ends (the tree keeps a node's identity across splits)
    back_s: float  # when it is expected back: paused_s + the gap learned for its gap_key
    paused_s: float
    # what it said of its return: (GraphHints.next_turn_after_s, 0 if unsaid; whether it
    # waits on its tools); returns are learned by it
    gap_key: tuple[float, bool]


class ProgramGate:
    """The programs in, their kept paths, and who enters next (see the module docstring)."""

    def __init__(self, kv: KVManager, step_time: StepTime, idle: IdleTime) -> None:
        self.kv = kv
        self.step_time = step_time
        self.idle = idle  # the engine's idle seconds: what a waiting program wastes
        # program key -> record, the least recently seen first; at most MAX_BRANCHES (a
        # client naming a new program per request keeps no more)
        self.programs: OrderedDict[tuple, ProgramRecord] = OrderedDict()
        self._running: dict[str, tuple] = {}  # rid of a running request -> its program key
        # branch key (owner, program, branch) -> Paused
        self.paused = BranchTable()
        # program key -> its branch keys that paused (some may have left `paused` since: the
        # table drops an owner's oldest); so asking whether a program is in reads its own
        self._paused_branches: dict[tuple, set[tuple]] = {}
        # what a return said (Paused.gap_key) -> the gap seen for it (decayed mean): a tool's
        # calls return when they do, not when the slowest offered tool said it might; tools
        # that declare no latency are learned apart from requests that continue right away
        self.gap_s: dict[tuple[float, bool], float] = {}
        # room kept free for the programs in to grow into, learned: a kept path lost to
        # eviction (the programs in outgrew the pool) adds its length, each entry that fits
        # takes off HEADROOM_DECAY of it
        self.pool_slots = kv.allocator.num_slots
        self.headroom_tokens = 0.0
        self.growth = ProgramGrowth(self.pool_slots)  # what programs grow by (learned)
        self.kept_lost_tokens = 0  # kept paths lost to eviction, their lengths (a counter)
        # what branches back from their tools computed again of the paths they paused at: the
        # prefill over the exact bound that keeping (or not keeping) paused paths decides
        self.returns_recomputed_tokens = 0
        # a lower tier keeps what the pool evicts: a paused program's path is then loaded
        # back on its return (prefetched ahead of it, lookahead.py), never recomputed
        self.tiers_keep = kv.tiers.keeps_evicted
        self.displaced = 0  # programs displaced by one of less attained service (a counter)

    # ------------------------------------------------------------------ what happens
    def arrived(self, req: Req, now_s: float) -> None:
        key = program_key(req)
        if key is None:
            return
        paused = self.paused.get(branch_key(req))
        if paused is not None and not req.queue.num_retractions:  # (a retraction is no return)
            self._learn_gap(paused, now_s)
        if key in self.programs:
            self.programs.move_to_end(key)
            return
        if len(self.programs) >= MAX_BRANCHES:  # the least recently seen that runs nothing
            idle = next((k for k, r in self.programs.items() if not r.num_running), None)
            self.programs.pop(idle, None)  # (all running: at most max_running_requests more)
        self.programs[key] = ProgramRecord(now_s)

    def _learn_gap(self, paused: Paused, now_s: float) -> None:
        """A branch is back from its tools: what its declared return really took."""
        seen = self.gap_s.get(paused.gap_key)
        gap = now_s - paused.paused_s
        self.gap_s[paused.gap_key] = gap if seen is None else seen + GAP_DECAY * (gap - seen)
        if len(self.gap_s) > MAX_BRANCHES:
            self.gap_s.pop(next(iter(self.gap_s)))

    def started(self, req: Req) -> None:
        key = program_key(req)
        if key is not None:
            record = self.programs.setdefault(key, ProgramRecord(0.0))
            record.num_running += 1
            record.priority = req.hints.priority
            cached = req.kv.num_computed  # (its cached prefix is taken by now)
            branch = req.hints.branch_id
            self.returns_recomputed_tokens += record.recomputed(branch, req.prompt_ids, cached)
            record.charge(branch, req.num_tokens - cached)  # the prompt it computes: service
            record.computed(req.num_tokens - cached, waits_on_return(req))  # ... growth
            self._running[req.rid] = key
            self.paused.pop(branch_key(req))  # its branch is back

    def paused_at(self, req: Req, position: TreePosition, now_s: float, declared_s: float) -> None:
        """A branch of a program paused with its path ending at `position` (locked now),
        declaring it is back `declared_s` from now (0: unsaid; expected back as soon as the
        returns seen for what it said took)."""
        key = program_key(req)
        if key is not None:
            node = self.kv.cache.resolve(position)
            record = self.programs.get(key)
            if record is not None:
                record.paused(req.hints.branch_id, node)
            gap_key = (declared_s, req.hints.waits_on_tools)
            back_s = now_s + self.gap_s.get(gap_key, declared_s)
            self.paused.put(branch_key(req), Paused(node, back_s, now_s, gap_key))
            self._paused_branches.setdefault(key, set()).add(branch_key(req))
            if len(self._paused_branches) > MAX_BRANCHES:  # (the table dropped some): prune
                self._paused_branches = {
                    k: live for k, b in self._paused_branches.items()
                    if (live := {x for x in b if self.paused.get(x) is not None})
                }  # fmt: skip

    def released(self, req: Req) -> None:
        key = self._running.pop(req.rid, None)
        record = self.programs.get(key)
        if record is None:
            return
        record.num_running -= 1
        record.decoded(len(req.gen.output_ids))
        # its work ended, as far as the gate can tell: its trunk finished a request that
        # nothing extends, and nothing of it runs (a program that goes on, forking after
        # such a request, counts its growth anew)
        trunk = (req.hints.branch_id or TRUNK) == TRUNK
        ended = trunk and req.gen.finished and not req.hints.continuation
        if ended and not record.num_running and record.first_tokens is not None:
            self.growth.ended(record)

    def advance(self, now_s: float) -> None:
        """Once a step: a paused branch whose path was evicted, or overdue past its return
        and the grace, is no longer kept."""
        for branch, (node, back_s, _, _) in self.paused.items():
            if node.evicted and not self.tiers_keep:  # the programs in outgrew the pool
                self.paused.pop(branch)
                self.kept_lost_tokens += node.depth
                self.headroom_tokens = min(self.headroom_tokens + node.depth, self.pool_slots)
            elif back_s + CONTINUATION_GRACE_S < now_s:
                self.paused.pop(branch)

    # ------------------------------------------------------------------ admission's questions
    def is_in(self, req: Req) -> bool:
        """Whether `req` needs no entry: it names no program, or its program is in (a request
        of it runs, or a branch of it paused and its path is still in the pool)."""
        key = program_key(req)
        return key is None or self._key_is_in(key, self.programs.get(key))

    def _key_is_in(self, key: tuple, record: ProgramRecord | None) -> bool:
        if record is not None and record.num_running > 0:
            return True
        branches = self._paused_branches.get(key, set())
        for branch in list(branches):
            paused = self.paused.get(branch)
            if paused is None:
                branches.discard(branch)  # back, forgotten or dropped since
            elif self.tiers_keep or not paused.node.evicted:
                return True  # (with a lower tier an evicted path is loaded back: still in)
        if not branches:
            self._paused_branches.pop(key, None)
        return False

    def kept_tokens(self) -> int:
        """Unlocked tokens on the paths the paused programs in will read again (each once)."""
        seen: set[int] = set()
        kept = 0
        for node, *_ in self.paused.values():
            while node.parent is not None and id(node) not in seen and not node.evicted:
                seen.add(id(node))
                if node.lock_ref == 0:
                    kept += len(node.key)
                node = node.parent
        return kept

    def entry_order(self, waiting: Iterable[Req], now_s: float) -> list[Req]:
        """The waiting requests that need entry, in the order their programs enter."""
        wall_s = time.monotonic()  # (waits are real time, whatever the scheduler's clock)

        def rank(req: Req) -> tuple:
            record = self.programs.get(program_key(req)) or ProgramRecord(now_s)
            starved = wall_s - req.usage.submitted_s >= STARVATION_S
            return (not starved, -req.hints.priority, record.critical_tokens, record.first_seen_s)

        return sorted((r for r in waiting if not self.is_in(r)), key=rank)

    def entered(self) -> None:
        self.headroom_tokens *= 1.0 - HEADROOM_DECAY

    def rank(self, record: ProgramRecord, priority: int | None = None) -> tuple[int, int]:
        """A program's rank, the lowest first: higher GraphHints.priority (`priority`, else
        its latest request's), then its service level (less attained service:
        program_service.service_level)."""
        quantum = max(1, int(self.pool_slots * SERVICE_QUANTUM_SHARE))
        priority = record.priority if priority is None else priority
        return -priority, service_level(record.critical_tokens, quantum)

    def request_rank(self, req: Req) -> tuple[int, int]:
        """The rank of `req`'s program at `req`'s priority (one that has computed nothing yet,
        or names no program, at service level 0)."""
        record = self.programs.get(program_key(req)) or ProgramRecord(0.0)
        return self.rank(record, req.hints.priority)

    def headroom_for(self, req: Req, takes_tokens: int) -> tuple[float, float]:
        """The room `req`'s program must leave free to enter, taking `takes_tokens` itself,
        for the programs in that it does not outrank to grow into, as (the growth still due
        to it and to each of them, ProgramGrowth.due_with; the learned headroom): none when it
        outranks every one (PLAS serves it before their growth: what they lose to it is what
        their rank costs them)."""
        rank = self.request_rank(req)
        key = program_key(req)
        peers = [r for k, r in self.programs.items()
                 if k != key and self.rank(r) <= rank and self._key_is_in(k, r)]  # fmt: skip
        if not peers:
            return 0.0, 0.0
        record = self.programs.get(key)
        return self.growth.due_with(req, record, takes_tokens, peers), self.headroom_tokens

    def displaced_by(self, req: Req, need_tokens: float) -> list[tuple[tuple, int]]:
        """The paused programs in (none of their requests running) of a lower rank than
        `req`'s program (lower priority, or the same and a lower service level), the lowest
        first, as many as free `need_tokens` (at least one) of what only their paths hold:
        (program key, tokens) each; none if they cannot."""
        rank = self.request_rank(req)
        outranked = []
        for key, branches in self._paused_branches.items():
            record = self.programs.get(key)
            if record is None or record.num_running or not branches:
                continue
            if (their_rank := self.rank(record)) > rank:
                nodes = {id(n): n for b in branches if (p := self.paused.get(b)) is not None
                         for n in private_path(p.node) if not n.lock_ref}  # fmt: skip
                tokens = sum(len(n.key) for n in nodes.values())
                outranked.append((their_rank, tokens, key))
        displaced = []
        # the lowest rank first, the most tokens first within it (keys may not compare)
        for _, tokens, key in sorted(outranked, key=lambda o: o[:2], reverse=True):
            if tokens:
                displaced.append((key, tokens))
                need_tokens -= tokens
                if need_tokens <= 0:
                    return displaced
        return []

    def waited_past_recompute(self, req: Req, evicts_tokens: int) -> bool:
        """Whether `req` has waited to enter as long as recomputing `evicts_tokens` takes
        (the measured cost per token): ski rental, the wait is the rent, a displaced program's
        recompute the purchase; entering then costs at most twice the better of the two."""
        waited_s = time.monotonic() - req.usage.submitted_s
        return waited_s >= self.recompute_s(evicts_tokens)

    def displace(self, key: tuple) -> None:
        """Program `key` is no longer in: its paused paths are not kept (the part only they
        hold goes first when the pool needs room), and its next request enters in order."""
        for branch in self._paused_branches.pop(key, ()):
            paused = self.paused.pop(branch)
            if paused is not None:
                self.kv.marks.forget_private(private_path(paused.node))
        self.displaced += 1

    def waiting_costs_more(self, evicts_tokens: int, now_s: float) -> bool:
        """Nothing runs: whether waiting for the soonest paused program to come back costs
        more than recomputing `evicts_tokens` of kept KV (the measured cost per token)."""
        fit = self.step_time.fit()
        expected = [p.back_s for p in self.paused.values() if p.back_s >= now_s - LATE_S]
        if fit is None or not expected:
            return True  # unmeasured, or every paused program is late: do not idle on a guess
        wait_s = min(max(0.0, min(expected) - now_s), MAX_HINT_RETURN_S)
        return fit[1] * evicts_tokens < wait_s

    def idled_past_recompute(self, req: Req, evicts_tokens: int) -> bool:
        """Whether the engine has sat idle, while `req` waited, as long as recomputing the
        `evicts_tokens` of kept KV its entry evicts would take: then it enters. Ski rental:
        waiting is rent, paid in compute the engine leaves unused; entering is the purchase,
        paid in compute spent again. Entering once the rent paid covers the price costs at
        most twice the better of waiting it out and entering at once, whatever the wait
        would have been. Where compute is the bottleneck the engine does not idle: it waits."""
        idled_s = self.idle.total_s() - req.queue.idle_at_arrival_s
        return idled_s >= self.recompute_s(evicts_tokens)

    def recompute_s(self, tokens: int) -> float:
        """What recomputing `tokens` takes at the measured cost per token (unmeasured: never
        worth paying for)."""
        fit = self.step_time.fit()
        return math.inf if fit is None else fit[1] * tokens

    def stats(self) -> dict[str, float]:
        return {
            "program_kept_lost_tokens_total": self.kept_lost_tokens,
            "program_returns_recomputed_tokens_total": self.returns_recomputed_tokens,
            "program_headroom_tokens": self.headroom_tokens,
            "program_growth_tokens": self.growth.mean_tokens(),
            "programs_displaced_total": self.displaced,
        }

    def check_integrity(self, running: Iterable[Req]) -> None:
        """Every running request (or held pin) of a program is counted, and its program is
        in; what the paused programs keep is evictable KV."""
        named = [r for r in running if program_key(r) is not None]
        assert all(r.rid in self._running for r in named), "a running request not counted"
        counts: Counter = Counter(map(program_key, named))
        for key, record in self.programs.items():
            assert record.num_running == counts.get(key, 0), f"program {key} miscounted"
        assert len(self._running) == sum(counts.values()), "a released request still counted"
        assert self.kept_tokens() <= self.kv.cache.evictable_size
        for branch, _ in self.paused.items():
            assert branch in self._paused_branches.get(branch[:2], ()), f"{branch} not indexed"
        for key, record in self.programs.items():  # (a record's branches are bounded)
            assert len(record.paused_nodes) <= MAX_PROGRAM_BRANCHES, f"program {key} unbounded"
            assert record.first_tokens is not None or not record.grown_tokens, f"{key} grew"


class NoPrograms:
    """The gate turned off: every request is in, nothing is kept."""

    def arrived(self, req: Req, now_s: float) -> None:
        pass

    def started(self, req: Req) -> None:
        pass

    def paused_at(self, req: Req, position: TreePosition, now_s: float, declared_s: float) -> None:
        pass

    def released(self, req: Req) -> None:
        pass

    def advance(self, now_s: float) -> None:
        pass

    def is_in(self, req: Req) -> bool:
        return True

    def request_rank(self, req: Req) -> tuple[int, int]:
        return -req.hints.priority, 0  # (no service is counted)

    def check_integrity(self, running: Iterable[Req]) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"program_kept_lost_tokens_total": 0, "program_headroom_tokens": 0.0,
                "programs_displaced_total": 0,
                "program_returns_recomputed_tokens_total": 0,
                "program_growth_tokens": 0.0}  # fmt: skip
