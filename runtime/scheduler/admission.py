"""Admission: which waiting requests start this step, as a sequence of small named checks.

One `AdmissionPass` a step walks the queue in the schedule policy's order. Each request meets
the checks in turn; each check lets it on (`ADMIT`), passes over it for now (`SKIP`: a later
request may start before it), or ends the pass (`STOP`: nothing after it starts). A request
that meets every check starts: it takes its cached prefix, its first chunk is sized within the
step's token budget, and it runs. (mini-sglang's PrefillAdder has the same shape.)

The checks, in order:
- room to run: token budget left, fewer than max_running_requests running;
- owner in order: an owner's later requests wait behind its first that does not fit, and a
  request retracted to make room for another owner's sits one pass out;
- ready to sample: its stop matching caught up, its first grammar mask ready;
- prefilled once: no running request computes the tokens it shares beyond its cache match;
- lower tiers ready: its chunk files are read (prefetch thread);
- program in: a request of a program not running nor paused with its KV kept enters in
  program order, if it fits beside the kept KV (programs.py); its program has entered once it
  starts (a later check may hold it, and the programs after it wait);
- fits: free + evictable slots cover what it computes and reserves to grow, and the
  unlocked part of its cached prefix (its lock holds that once it starts), or another
  owner's request may pass it (at most admission_patience times);
- not deferred: graph eviction keeps what the work ahead reads soon (lookahead.py).
"""

from __future__ import annotations

from collections.abc import Hashable
from enum import Enum
from typing import TYPE_CHECKING

from runtime.cache.nodes import owner_of
from runtime.scheduler.entries import BatchEntry, prefill_entry
from runtime.scheduler.request import Req

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler


def admit(scheduler: Scheduler, budget: int) -> list[BatchEntry]:
    """The entries of the waiting requests that start this step within `budget` tokens."""
    full = len(scheduler.running) >= scheduler.config.max_running_requests
    if budget <= 0 or not scheduler.waiting or full:
        return []
    return AdmissionPass(scheduler, budget).run()


class Verdict(Enum):
    ADMIT = "admit"
    SKIP = "skip"  # not now; later requests may start
    STOP = "stop"  # not now, and nothing after it either


ADMIT, SKIP, STOP = Verdict.ADMIT, Verdict.SKIP, Verdict.STOP


class AdmissionPass:
    """One step's admission over the scheduler's queue (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, budget: int) -> None:
        self.s = scheduler
        self.budget = budget
        self.entries: list[BatchEntry] = []
        self.reserved = sum(map(scheduler.reserved_slots, scheduler.running))
        self.available = scheduler.kv.available_slots(self.reserved)
        self.deferred: list[Req] = []  # passed over; each request admitted after them passes them
        self.blocked: set[Hashable] = set()  # owners whose first waiting request does not fit
        self.work_ahead = scheduler.lookahead.work_ahead(scheduler.running)
        self.programs = scheduler.lookahead.programs
        self.entrants: list[Req] | None = None  # requests of programs not in, in entry order
        self.kept = 0  # tokens the paused programs in keep (unlocked), taken with entrants
        self.entry_closed = False  # a program that does not fit holds every one after it
        # the request whose program passed `program_in` this pass, and its counter: it has
        # entered once it starts (a later check may still hold it)
        self.entering: tuple[Req, str] | None = None

    def run(self) -> list[BatchEntry]:
        """The entries of the requests that start this step."""
        s = self.s
        for req in s.policy.order(list(s.waiting.values())):
            verdict = self.check(req)
            if verdict is STOP:
                break
            if verdict is SKIP:
                continue
            if not self.start(req):
                break
            self.entry_started(req)
        return self.entries

    def check(self, req: Req) -> Verdict:
        """The checks in order; the first that does not admit decides."""
        for check in (self.room_to_run, self.owner_in_order, self.ready_to_sample):
            verdict = check(req)
            if verdict is not ADMIT:
                return verdict
        self.s.prompt_logits.offer(req)  # a row kept for its whole prompt: it may match it all
        checks = (self.prefilled_once, self.lower_tiers_ready, self.program_in, self.fits)
        for check in (*checks, self.not_deferred):
            verdict = check(req)
            if verdict is not ADMIT:
                self.entry_held(req)
                return verdict
        return ADMIT

    # ------------------------------------------------------------------ the checks
    def room_to_run(self, req: Req) -> Verdict:
        s = self.s
        full = len(s.running) >= s.config.max_running_requests
        return STOP if self.budget <= 0 or full else ADMIT

    def owner_in_order(self, req: Req) -> Verdict:
        """Its owner's earlier request does not fit, or it was retracted for another owner's
        (it sits this pass out: the room it made goes to the request it was made for)."""
        if req.queue.yielded:
            req.queue.yielded = False
            return SKIP
        return SKIP if owner_of(req.namespace) in self.blocked else ADMIT

    def ready_to_sample(self, req: Req) -> Verdict:
        """(A retracted request) matching its stops, or its first mask not ready: skip."""
        if req.gen.checking_stops or not self.s.grammar.can_sample(req, admitting=True):
            return SKIP
        return ADMIT

    def prefilled_once(self, req: Req) -> Verdict:
        """Exact prefill-once: wait for the running request computing what it shares."""
        s = self.s
        if s.kv.running_computes_shared(req, s.policy.match(req).prefix_len, s.running):
            s.counters["prefill_waits"] += 1
            return SKIP
        return ADMIT

    def lower_tiers_ready(self, req: Req) -> Verdict:
        s = self.s
        if not s.lookahead.lower_ready(req, s.policy.match(req)):
            s.counters["disk_waits"] += 1  # its chunk files are being read
            return SKIP
        return ADMIT

    def program_in(self, req: Req) -> Verdict:
        """Its program is in, or it is the next program to enter and fits beside the KV the
        paused programs keep, or holding it back costs more than recomputing what it evicts of
        theirs (programs.py)."""
        s, programs = self.s, self.programs
        if programs.is_in(req) or s.need(req) > s.kv.allocator.num_slots:
            return ADMIT  # (one larger than the pool never enters: `fits` fails it at once)
        if self.entrants is None:
            self.entrants = programs.entry_order(s.waiting.values(), s.lookahead.now_s)
            self.kept = programs.kept_tokens()
        while self.entrants and (
            self.entrants[0].rid not in s.waiting or programs.is_in(self.entrants[0])
        ):
            self.entrants.pop(0)  # started this pass, or its program entered meanwhile
        if self.entry_closed or not self.entrants or self.entrants[0] is not req:
            return SKIP  # not its program's turn
        # kept KV it would evict, and the room it and the programs in grow into
        takes = self.takes(req)
        growth, learned = programs.headroom_for(req, takes)
        short = takes + self.kept + growth + learned - self.available
        # (lacking room only for the growth due, it displaces none: displacing would evict a
        # paused program's path for growth that has not come, and newcomers often lack that)
        lacks = short - growth
        if (
            short <= 0
            or self.entry_priced(req, short)
            or (lacks > 0 and self.displaces_for(req, lacks - learned))
        ):
            self.entrants.pop(0)
            self.entering = (req, "programs_entered" if short <= 0 else "programs_entered_priced")
            return ADMIT
        self.entry_closed = True
        s.counters["program_entries_deferred"] += 1
        return SKIP

    def entry_started(self, req: Req) -> None:
        """`req` started: if its program was let in this pass, it has entered (counted, and
        the learned headroom decays by one entry)."""
        if self.entering is not None and self.entering[0] is req:
            self.programs.entered()
            self.s.counters[self.entering[1]] += 1
            self.entering = None

    def entry_held(self, req: Req) -> None:
        """A check after `program_in` held `req` (it does not fit the pool now, or graph
        eviction keeps the room for work ahead): its program has not entered, and the programs
        after it in entry order wait behind it. Counted as an entry, every pass it was held
        decayed the learned headroom: 100-150 "entries" of two programs held by graph eviction
        took it to nothing, and the 8-agent cell computed 1.43-1.47x the bound (RESULTS.md)."""
        if self.entering is not None and self.entering[0] is req:
            self.entering = None
            self.entry_closed = True

    def entry_priced(self, req: Req, short: int) -> bool:
        """A program that does not fit beside the kept KV enters anyway when recomputing the
        `short` tokens it evicts costs less than the engine has idled since it arrived, or,
        with nothing running, than waiting for the soonest return (programs.py)."""
        programs = self.programs
        if programs.idled_past_recompute(req, short):
            return True
        if not self.s.running and not self.entries:
            return programs.waiting_costs_more(short, self.s.lookahead.now_s)
        return False

    def displaces_for(self, req: Req, short: int) -> bool:
        """Paused programs of a lower rank (lower priority, or more attained service: PLAS)
        give up their kept KV to `req`'s program when that makes its `short` tokens fit beside
        the other kept KV, the lowest first: at least one of them, whose room stands in for the
        learned headroom the programs in keep to grow into. Priced by ski rental: only once
        `req` has waited as long as recomputing what they give up would take (programs.py)."""
        programs = self.programs
        displaced = programs.displaced_by(req, short)
        if not displaced or not programs.waited_past_recompute(req, sum(t for _, t in displaced)):
            return False
        for key, _ in displaced:
            programs.displace(key)
        self.kept = programs.kept_tokens()
        return True

    def fits(self, req: Req) -> Verdict:
        """It fits now; else it failed as too large for the pool, or other owners' requests
        that fit may pass it (at most `admission_patience` times: a tenant's long requests
        never hold another's short one), or admission stops at it."""
        s = self.s
        need = self.takes(req)
        if need <= self.available:
            return ADMIT
        if not s.running and not self.entries and need > s.kv.capacity_for_one:
            fail_too_large(s, req, need)
            return SKIP
        if req.queue.num_passed >= s.config.admission_patience:
            return STOP  # passed often enough: no later request starts before it
        self.blocked.add(owner_of(req.namespace))  # its owner's later requests wait behind it
        self.deferred.append(req)  # counted as passed by each request admitted after it
        return SKIP

    def not_deferred(self, req: Req) -> Verdict:
        """Graph eviction: whether it waits so that work ahead keeps its KV."""
        s = self.s
        if self.work_ahead.defers(req, s.need(req), self.reserved, s.config.admission_patience):
            s.counters["admissions_held"] += 1
            self.deferred.append(req)
            return SKIP
        return ADMIT

    def takes(self, req: Req) -> int:
        """What admitting `req` takes of the slots admission may promise: what it computes
        and reserves to grow, and the unlocked part of its cached prefix, which its lock then
        holds (counted as evictable, it would be promised twice: once to its own new tokens;
        then its first chunk cannot get slots, and with nothing running it never would)."""
        s = self.s
        return s.need(req) + s.kv.cache.unlocked_tokens(s.policy.match(req))

    # ------------------------------------------------------------------ starting
    def start(self, req: Req) -> bool:
        """Start an admitted request: take its prefix and size its first chunk. False if
        eviction could not produce its slots after all (it waits; the pass ends)."""
        s = self.s
        need = self.takes(req)
        del s.waiting[req.rid]
        s.start(req, s.policy.match(req))
        self.programs.started(req)
        self.available -= need
        if req.reuse.logits is not None and req.kv.num_computed < req.num_tokens:
            req.reuse.logits = None  # the tree lost the prompt's end: compute it
        num_new = min(req.num_tokens - req.kv.num_computed, self.budget)
        if num_new == 0 and req.reuse.logits is not None:
            s.running.append(req)  # samples from the kept row; computes nothing
            self.entries.append(BatchEntry(req, 0, False, False, True))
            self.reserved += s.reserved_slots(req)
            return True
        if num_new == 0:  # everything cached and no logits needed
            s.complete(req)
            return True
        if not s.kv.grow(req, req.kv.num_computed + num_new):
            s.unstart(req)  # eviction could not produce the slots: try next step
            return False
        s.running.append(req)
        self.entries.append(prefill_entry(req, num_new, s.prompt_logits.max_rows > 0))
        self.budget -= num_new
        self.reserved += s.reserved_slots(req)
        self.work_ahead.admitted(req)
        for waiting in self.deferred:
            waiting.queue.num_passed += 1
        return True


def fail_too_large(s: Scheduler, req: Req, need: int) -> None:
    """Fail `req`, which cannot run with what the pool holds: busy (retry later) when it
    fits an empty pool, else too large for it."""
    pool, held = s.kv.allocator.num_slots, s.kv.cache.protected_size
    if need <= pool:  # it fits an empty pool: pins and running prefixes are in the way
        message = f"request needs {need} KV slots; {held} of {pool} are held: retry later"
        s.fail(req, message, kind="busy")
        return
    s.fail(req, f"request needs {need} KV slots, the pool has {pool}: raise max_kv_tokens")
