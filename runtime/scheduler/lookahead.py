"""What the scheduler knows of the future, kept once a step (`Lookahead`), and what admission
asks of it.

The graph is the program: a branch that paused will be back (right away, or when it declared),
and the waiting queue says which cached paths are read next. Once a step the scheduler hands
the lookahead the queue's head; it reads the clock, lets the eviction marks forget overdue
continuations, and keeps in host memory what is read next (the queue's first requests, and
branches whose declared return is near), reading chunk files on the tiers' prefetch thread.
Admission asks it whether a request's chunk files are read (`lower_ready`), and, under graph
eviction, whether the work ahead keeps a request waiting (`flight(...).defers`).
`WorkAhead` is one admission pass's view of the work ahead; `NoWorkAhead` is the same
interface for policies that do not look ahead: nothing is deferred.
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from runtime.cache.graph_policy import CONTINUATION_GRACE_S
from runtime.cache.nodes import TreePosition, owner_of
from runtime.config import EngineConfig
from runtime.protocol import MAX_HINT_RETURN_S
from runtime.scheduler.branches import BranchTable, branch_key, future_tokens
from runtime.scheduler.kv import KVManager
from runtime.scheduler.programs import NoPrograms, ProgramGate
from runtime.scheduler.request import Req
from runtime.scheduler.step_time import IdleTime, StepTime
from runtime.scheduler.ttl_pins import NoTtlPins, TtlPins

PREFETCH_QUEUE_DEPTH = 16  # waiting requests, in admission order, whose disk chunks are prefetched
PREFETCH_LEAD_S = 2.0  # a branch that declared its return is prefetched this long before it
# admission waits at most this long for a request's chunk files to be read (prefetch thread);
# then it starts and computes what is not read (a slow or hostile disk holds nobody longer)
DISK_WAIT_S = 2.0


class Lookahead:
    """Paused branches, declared returns, prefetching and disk waits (see the module)."""

    def __init__(
        self, kv: KVManager, step_time: StepTime, idle: IdleTime, config: EngineConfig
    ) -> None:
        self.kv = kv
        # admission holds back requests that would evict KV a known reader needs soon
        self.keeps_wanted = kv.marks.keeps_wanted
        # programs as the unit of admission (programs.py): with eviction that keeps their KV
        gated = config.program_admission and self.keeps_wanted
        self.programs = ProgramGate(kv, step_time, idle) if gated else NoPrograms()
        ttl_s = config.tool_pin_ttl_s  # Continuum's fixed pin at tool calls (ttl_pins.py)
        self.ttl_pins = TtlPins(kv.cache, ttl_s) if ttl_s > 0 else NoTtlPins()
        # seconds; times when paused branches are expected back (benchmarks set a simulated one)
        self.clock: Callable[[], float] = time.monotonic
        self.now_s = 0.0  # read once a step: branches pausing in one step tie, deterministically
        # paused branches back right away: branch key -> (pause s, tokens still to come)
        self.paused_branches = BranchTable()
        # branches that declared when they return: branch key -> (return s, namespace, ids,
        # their chunk names), prefetched from disk PREFETCH_LEAD_S ahead
        self.returning = BranchTable()
        self._disk_waits: dict[str, float] = {}  # rid -> when admission began to wait for files

    # ------------------------------------------------------------------ once a step
    def read_clock(self) -> None:
        """First in a step, before anything is released: the clock paused branches are timed
        by, overdue continuations forgotten (and the lower tiers' changes of the last step
        published as KV events)."""
        self.now_s = self.clock()
        self.kv.marks.advance(self.now_s)
        self.programs.advance(self.now_s)
        self.ttl_pins.advance(self.now_s)
        self.kv.tiers.flush_events()

    def prefetch(self, queue_head: Iterable[tuple[Req, TreePosition]]) -> None:
        """Keep in host memory what the graph says is read next (`queue_head`: the waiting
        requests in admission order with their matches, read lazily: the first few; then
        branches whose declared return is near), loading it from disk if need be, so
        admission copies from host memory. Never waits."""
        tiers = self.kv.tiers
        if tiers.hold_budget_chunks <= 0:
            return
        budget = tiers.hold_budget_chunks  # the soonest readers first; held chunks never lapse
        for req, position in itertools.islice(queue_head, PREFETCH_QUEUE_DEPTH):
            if budget <= 0:
                return
            ids, start, limit = req.all_ids, position.prefix_len, req.match_limit
            extent = tiers.extent(req.namespace, ids, start, limit, req.kv.chunk_names)
            budget -= tiers.prefetch(extent, budget)
        for key, (return_s, namespace, ids, names) in self.returning.items():
            if return_s + CONTINUATION_GRACE_S < self.now_s:
                self.returning.pop(key)  # it never came back
            elif return_s - PREFETCH_LEAD_S <= self.now_s and budget > 0:
                start = self.kv.cache.match_prefix(ids, namespace).prefix_len
                budget -= tiers.prefetch(
                    tiers.extent(namespace, ids, start, len(ids), names), budget
                )

    # ------------------------------------------------------------------ branches
    def arrived(self, req: Req) -> None:
        """A request reached the queue: its branch's next turn is no longer to come."""
        # (when it arrived, not when the last step ran: a return's gap is what its tools took,
        # and an idle engine may have stepped last long before)
        self.programs.arrived(req, self.clock())
        self.ttl_pins.arrived(req)
        if self.paused_branches or self.returning:
            key = branch_key(req)  # the owner's own branch: another tenant's is never touched
            self.paused_branches.pop(key)
            self.returning.pop(key)

    def paused(self, req: Req) -> None:
        """A request finished with its computed KV in the tree, locked at req.kv.lock_pos: if its
        branch continues, mark its path and remember it (bounded per owner) as work ahead
        or as a declared return to prefetch for."""
        hints = req.hints
        if not hints.continuation or req.kv.lock_pos is None:
            return
        # a return declared further out than the horizon is "not soon", however far
        after_s = min(hints.next_turn_after_s or 0.0, MAX_HINT_RETURN_S)
        self.kv.marks.mark_continuation(req.kv.lock_pos, self.now_s + after_s, not after_s)
        if hints.program_id is None:
            return
        self.ttl_pins.paused(req, req.kv.lock_pos, self.now_s)  # (per branch: programs only)
        self.programs.paused_at(req, req.kv.lock_pos, self.now_s, after_s)
        key = branch_key(req)
        if not after_s and self.keeps_wanted:
            tokens = future_tokens(req, self.kv.allocator.num_slots)
            self.paused_branches.put(key, (self.now_s, tokens))
        if after_s and self.kv.tiers.hold_budget_chunks > 0:
            ids = array("i", req.tokens(0, req.kv.num_locked))  # 4 bytes a token, not 36
            self.returning.put(key, (self.now_s + after_s, req.namespace, ids, []))

    def released(self, req: Req) -> None:
        """A request gave up its KV (finished, retracted, aborted): it waits for no file."""
        self._disk_waits.pop(req.rid, None)
        self.programs.released(req)

    def tokens_ahead(self, running: Sequence[Req]) -> Counter:
        """Per owner, about how many tokens the work ahead will still add
        (GraphHints.future_tokens, each at most the pool): branches paused to come back right
        away (within the grace) and running requests."""
        expired = [
            key
            for key, (pause_s, _) in self.paused_branches.items()
            if pause_s < self.now_s - CONTINUATION_GRACE_S
        ]
        for key in expired:
            self.paused_branches.pop(key)
        tokens: Counter = Counter()
        for (owner, _, _), (_, paused) in self.paused_branches.items():
            tokens[owner] += paused
        for req in running:
            tokens[owner_of(req.namespace)] += future_tokens(req, self.kv.allocator.num_slots)
        return tokens

    # ------------------------------------------------------------------ admission's questions
    def lower_ready(self, req: Req, position: TreePosition) -> bool:
        """Are the chunk files that continue this match read (on the prefetch thread: the
        loop thread never reads a file), or has it waited DISK_WAIT_S for them (then what is
        not read is computed)?"""
        tiers = self.kv.tiers
        if not tiers.keeps_evicted:
            return True  # nothing below the pool (NoTiers): no prompt copy every step
        ids, start = req.all_ids, position.prefix_len
        extent = tiers.extent(req.namespace, ids, start, req.match_limit, req.kv.chunk_names)
        if tiers.ready(extent):
            self._disk_waits.pop(req.rid, None)
            return True
        now_s = time.monotonic()  # file reads take real time, whatever `clock` simulates
        return now_s - self._disk_waits.setdefault(req.rid, now_s) > DISK_WAIT_S

    def work_ahead(self, running: list[Req]) -> WorkAhead | NoWorkAhead:
        """One admission pass's view of the work ahead (graph eviction), or none."""
        return WorkAhead(self, running) if self.keeps_wanted else NoWorkAhead()


class NoWorkAhead:
    """Eviction that does not look ahead: admission holds nothing back."""

    def defers(self, req: Req, need: int, reserved: int, patience: int) -> bool:
        return False

    def admitted(self, req: Req) -> None:
        pass


class WorkAhead:
    """One admission pass's view of the work ahead (graph eviction), taken on first need:
    per owner, the tokens paused and running programs will still add and the tokens running
    requests hold; and fresh queued-read marks."""

    def __init__(self, lookahead: Lookahead, running: list[Req]) -> None:
        self.lookahead = lookahead
        self.kv = lookahead.kv
        self.running = running
        self._hinted: Counter | None = None
        self._held: Counter = Counter()
        self._marked = False

    def future_tokens(self, req: Req) -> int:
        """The room `req` leaves for work ahead, its own later turns included. A hint is
        advice, never a reservation: another owner's hints count up to its share of the pool
        (the pool split evenly among the owners with work ahead and `req`'s) less what its
        running requests hold, so no owner's hints hold another's requests beyond it. The
        owner's own count whole: its own work ahead holds its own new work, as it should
        (capped at its share less what it holds, one owner's run_batch let new conversations
        in that its running ones then evicted: 23,416 tokens computed became 28,880 on the
        48 x 3 batch at 35%, RESULTS.md)."""
        if self._hinted is None:
            self._hinted = self.lookahead.tokens_ahead(self.running)
            for running in self.running:
                self._held[owner_of(running.namespace)] += running.num_tokens
        mine = owner_of(req.namespace)
        own = future_tokens(req, self.kv.allocator.num_slots)
        owners = {*self._hinted, *self._held, mine}
        share = self.kv.allocator.num_slots // len(owners)
        total = 0
        for owner in owners:
            if owner == mine:
                total += self._hinted.get(owner, 0) + own
            else:
                total += min(self._hinted.get(owner, 0), max(0, share - self._held[owner]))
        return total

    def admitted(self, req: Req) -> None:
        if self._hinted is not None:
            owner = owner_of(req.namespace)
            self._hinted[owner] += future_tokens(req, self.kv.allocator.num_slots)
            self._held[owner] += req.num_tokens

    def unwanted_slots(self, reserved: int) -> int:
        if not self._marked:
            self.kv.mark_queued_reads()
            self._marked = True
        return self.kv.available_slots(reserved) - self.kv.cache.wanted_size

    def defers(self, req: Req, need: int, reserved: int, patience: int) -> bool:
        """Whether `req` waits so that work ahead keeps its KV (Belady's victim would be
        what a running request leaves behind once done; the cyclic case).
        - New work (it computes more than it reads from the cache) waits unless free and
          unwanted KV cover it and what the work ahead will still add (future_tokens);
        - a request that mostly reads the cache waits only if it would evict more KV that
          others read soon (waiting requests, branches back right away) than it reads.
        It never waits with nothing running, nor once `patience` requests passed it."""
        if not self.running or req.queue.num_passed >= patience:
            return False
        reads = req.queue.match_pos.prefix_len
        new_work = req.num_tokens - reads > reads
        # room for the work ahead to finish, this request's own later turns included
        room = need + (self.future_tokens(req) if new_work else 0)
        if room <= self.kv.allocator.num_free_slots - reserved:
            return False
        unwanted = self.unwanted_slots(reserved)
        return room - unwanted > (0 if new_work else reads)
