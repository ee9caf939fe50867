"""The scheduler decides: which requests run next and how much of each; it never runs the model.

`schedule()` builds one mixed batch: decodes of every running request, then prefill chunks of
running and newly admitted requests up to the token budget (a constrained request decodes, or is
admitted, once its grammar mask is ready: grammar_gate.py). `process(batch, logits)` applies a
forward pass's logits: counts, prompt logprobs, sampling, stop rules, inserting computed KV into
the tree, finishing. It needs slot counts and logits only, so it is tested with fake logits.
Everything here runs on the engine's loop thread.

Prefill once, exactly: a waiting request is not admitted while a running request is computing
(or holds, not yet inserted) tokens it shares beyond its own cache match; it waits for their
insertion, which happens after every prefill chunk. So each uncached token range is computed
by one request only, and a cold batch computes exactly its union prefix tree.

Memory pressure: when decodes cannot get slots even after eviction, the latest admitted
requests are retracted: their computed KV goes into the tree unlocked (not dropped), they go
back to the front of the queue, and on resumption reuse whatever survived eviction.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from runtime.cache.radix import RadixCache, owner_of
from runtime.cache.tiers import KVTiers
from runtime.cache.token_index import TokenIndex
from runtime.config import EngineConfig
from runtime.generation import StopBudget
from runtime.model.batch import ForwardBatch
from runtime.scheduler.drafts import Drafter
from runtime.scheduler.grammar_gate import GrammarGate
from runtime.scheduler.kv import KVManager, future_tokens
from runtime.scheduler.policy import SchedulePolicy
from runtime.scheduler.prompt_logits import PromptLogits
from runtime.scheduler.request import Req, ReqKind, ReqStatus
from runtime.scheduler.shares import fair_share_victims

if TYPE_CHECKING:
    from runtime.verify import EntryOutcome

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens reserved for running requests' growth
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.005  # per step, while nothing is retracted


@dataclass(frozen=True)
class BatchEntry:
    """One request's part of a step: `num_new` tokens after its `num_computed`."""

    req: Req
    num_new: int
    is_decode: bool
    all_logits: bool  # logits at every new position (prompt logprobs)
    wants_logits: bool  # logits at the last new position at least
    draft: tuple[int, ...] = ()  # guessed tokens fed after the real ones, to verify

    @property
    def reuses_logits(self) -> bool:
        """Nothing to compute: it samples from the logits kept after its whole prompt."""
        return self.num_new == 0 and not self.draft

    @property
    def num_logit_rows(self) -> int:
        if self.draft:
            return len(self.draft) + 1
        return self.num_new if self.all_logits else int(self.wants_logits)


@dataclass(frozen=True)
class ScheduledBatch:
    entries: list[BatchEntry]  # those that compute first (rows in order), then reused rows'
    forward: ForwardBatch | None  # None when every entry reuses kept logits


TIMEOUT_MESSAGE = "the request's timeout passed before it finished"


class Scheduler:
    """Admission on the prefix cache, mixed batches, retraction, output processing."""

    def __init__(self, config: EngineConfig, num_slots: int, tiers: KVTiers | None = None) -> None:
        self.config = config
        self.waiting: dict[str, Req] = {}
        self.running: list[Req] = []
        self.pins: dict[str, Req] = {}
        self.kv = KVManager(config, num_slots, self._queued_positions, tiers)
        shares = isinstance(self.kv.cache, RadixCache)  # (a row is used with a whole-prompt hit)
        self.prompt_logits = PromptLogits(config.reuse_prompt_logits if shares else 0)
        self.policy = SchedulePolicy(config.schedule_policy, self.kv.cache, config.seed)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.counters: Counter[str] = Counter()
        self._admit_seq = 0
        self._deadlines: list[tuple[float, int, Req]] = []  # heap: soonest first
        self._checking: dict[str, Req] = {}  # stop_regex matching behind: catching up
        self.grammar = GrammarGate(config.grammar_step_budget_ms, config.grammar_mask_threads)
        self.drafter: Drafter | None = None
        if config.speculative == "tree":
            index = None
            if isinstance(self.kv.cache, RadixCache):
                index = self.kv.cache.token_index = TokenIndex(num_slots)
            self.drafter = Drafter(config.spec_max_draft_tokens, index)

    # ------------------------------------------------------------------ intake
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting[req.rid] = req
        self.kv.arrived(req)
        self.grammar.start(req)  # its first mask, filled while it waits
        if req.deadline is not None:  # a retracted request comes back: a second entry is inert
            heapq.heappush(self._deadlines, (req.deadline, req.arrival, req))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> bool:
        """Stop a waiting or running request, or release a pin; False if unknown."""
        req = self.waiting.pop(rid, None) or next((r for r in self.running if r.rid == rid), None)
        if req is not None:
            self._finish(req, "abort")
            return True
        pin = self.pins.pop(rid, None)
        if pin is not None:
            self.kv.release(pin, insert=False)
            pin.status = ReqStatus.FINISHED
        return pin is not None

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, with every slot it writes allocated; None if nothing can run."""
        self.kv.read_clock()
        self._abort_expired()
        if self.kv.prefetches and self.waiting:  # lazily: only the first few are matched
            order = self.policy.order(list(self.waiting.values()))
            self.kv.prefetch((req, self.policy.match(req)) for req in order)
        self.grammar.prepare([r for r in self.running if r.is_decoding])
        stop_budget = StopBudget()  # one for the step: catching up and sampling share it
        self._catch_up_stops(stop_budget)
        self._keep_shares()
        entries = self._schedule_entries()
        if not entries:
            if not self._checking:
                self.grammar.idle()
            return None
        for entry in entries:
            entry.req.gen.new_step(stop_budget)  # what its sampling may match (what is left)
        self.counters["steps"] += 1
        used = self.kv.allocator.num_used_slots
        self.counters["peak_used_slots"] = max(self.counters["peak_used_slots"], used)
        return self.batch_of(entries)

    @staticmethod
    def batch_of(entries: list[BatchEntry]) -> ScheduledBatch:
        """The forward batch for `entries` (their slots are already allocated); entries that
        reuse kept logits compute nothing and go last."""
        computed = [e for e in entries if not e.reuses_logits]
        forward = None
        if computed:
            forward = ForwardBatch.build(
                [
                    e.req.tokens(e.req.num_computed, e.req.num_computed + e.num_new) + list(e.draft)
                    for e in computed
                ],
                [e.req.slots[: e.req.num_computed + e.num_new + len(e.draft)] for e in computed],
                logit_tails=[e.num_logit_rows for e in computed],
            )
        return ScheduledBatch(computed + [e for e in entries if e.reuses_logits], forward)

    def _schedule_entries(self) -> list[BatchEntry]:
        while True:
            self._ensure_decode_slots()
            decoding = [r for r in self.running if r.is_decoding]
            budget = self.config.chunked_prefill_tokens
            entries = []
            for req in decoding:
                # else: stop matching is behind (_catch_up_stops), or its mask is not ready
                if not req.gen.checking_stops and self.grammar.can_sample(req):
                    entry = _decode_entry(req, budget)
                    budget -= entry.num_new - 1
                    entries.append(entry)
            num_deferred = len(decoding) - len(entries)
            if self.drafter is not None and len(entries) <= self.config.spec_max_batch:
                entries = [
                    self._with_draft(e, len(entries)) if e.wants_logits else e for e in entries
                ]
            for req in [r for r in self.running if not r.is_decoding]:
                num_new = min(req.num_tokens - req.num_computed, budget)
                if num_new <= 0 or not self.kv.grow(req, req.num_computed + num_new):
                    break
                entries.append(_prefill_entry(req, num_new, self.prompt_logits.max_rows > 0))
                budget -= num_new
            if budget > 0 and self.waiting and len(self.running) < self.config.max_running_requests:
                entries += self._admit(budget)
            if entries or not self.running or num_deferred:
                return entries  # (none while decodes wait for masks: they will run soon)
            # only prefills that cannot get memory: make room by retracting, or fail the last
            if len(self.running) == 1:
                self._fail_too_large(self.running[0], self.running[0].num_tokens)
            else:
                self.retract(max(self.running, key=lambda r: r.admit_seq))

    def _with_draft(self, entry: BatchEntry, num_decodes: int) -> BatchEntry:
        """A decode entry with the request's guess of what follows, if it has one and free
        slots hold it (a guess never evicts anything)."""
        req = entry.req
        draft = self.drafter.draft(req, self.running, num_decodes)
        draft = draft[: self.grammar.max_draft_tokens(req, len(draft))]
        if not draft or not self.kv.grow(req, req.num_tokens + len(draft), evict=False):
            return entry
        return replace(entry, draft=tuple(draft))

    def _catch_up_stops(self, budget: StopBudget) -> None:
        """Requests whose stop_regex matching is behind (it is bounded per step) read on,
        within the step's one budget, all of them together; they sample again once caught up
        (generation.py). The first in line may spend it all: it goes last next step."""
        checking = list(self._checking.values())
        for req in checking:
            req.gen.new_step(budget)
            req.gen.catch_up()
            _notify(req.on_delta, req)
            if req.gen.finished:
                self.waiting.pop(req.rid, None)  # (retracted meanwhile)
                self._finish(req, req.gen.finish_reason)
            elif not req.gen.checking_stops:
                del self._checking[req.rid]
        if checking and checking[0].rid in self._checking:  # round robin: none is starved
            self._checking[checking[0].rid] = self._checking.pop(checking[0].rid)

    def _abort_expired(self) -> None:
        """Abort requests past their deadline (timeout_s); with none due, one comparison."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] < now:
            req = heapq.heappop(self._deadlines)[2]
            if req.status in (ReqStatus.WAITING, ReqStatus.RUNNING):
                self.fail(req, TIMEOUT_MESSAGE, "abort", kind="timeout")

    def _admit(self, budget: int) -> list[BatchEntry]:
        entries: list[BatchEntry] = []
        reserved = sum(map(self._reserved_slots, self.running))
        available = self.kv.available_slots(reserved)
        held: list[Req] = []  # held back to keep what others read soon; admitted ones pass them
        flight = _InFlight(self.kv, self.running) if self.kv.keeps_wanted else None
        blocked: set[Hashable] = set()  # owners whose first waiting request does not fit
        for req in self.policy.order(list(self.waiting.values())):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if owner_of(req.namespace) in blocked:
                continue  # an owner's requests start in order: its earlier one waits for room
            if req.gen.checking_stops or not self.grammar.can_sample(req, admitting=True):
                continue  # (retracted) matching its stops, or its first mask is not ready
            self.prompt_logits.offer(req)  # a row kept for its whole prompt: it may match it all
            position = self.policy.match(req)  # reused: admission never matches again
            if self.kv.shares_inflight(req, position.prefix_len, self.running):
                self.counters["prefill_waits"] += 1
                continue
            if not self.kv.lower_ready(req, position):
                self.counters["disk_waits"] += 1  # its chunk files are being read
                continue
            need = self._need(req)
            if need > available:
                if self._passed_by_others(req, need, blocked, held, admitted_any=bool(entries)):
                    continue
                break
            if flight is not None and self._holds_back(req, need, reserved, flight):
                held.append(req)
                continue
            del self.waiting[req.rid]
            self._start(req, position)
            available -= need
            if req.reused_logits is not None and req.num_computed < req.num_tokens:
                req.reused_logits = None  # the tree lost the prompt's end: compute it
            num_new = min(req.num_tokens - req.num_computed, budget)
            if num_new == 0 and req.reused_logits is not None:
                self.running.append(req)  # samples from the kept row; computes nothing
                entries.append(BatchEntry(req, 0, False, False, True))
                reserved += self._reserved_slots(req)
                continue
            if num_new == 0:  # everything cached and no logits needed
                self._complete(req)
                continue
            if not self.kv.grow(req, req.num_computed + num_new):
                # eviction could not produce the slots: back to waiting, try next step
                self.counters["cached_tokens"] -= req.num_locked - req.num_loaded
                self.kv.release(req, insert=False)
                self.add(req)
                break
            self.running.append(req)
            entries.append(_prefill_entry(req, num_new, self.prompt_logits.max_rows > 0))
            budget -= num_new
            reserved += self._reserved_slots(req)
            if flight is not None:
                flight.admitted(req)
            for waiting in held:
                waiting.num_passed += 1
        return entries

    def _passed_by_others(
        self, req: Req, need: int, blocked: set[Hashable], held: list[Req], admitted_any: bool
    ) -> bool:
        """`req` does not fit now: whether later requests may still start this step (it failed
        as too large for the pool, or other owners' requests that fit may pass it, at most
        `admission_patience` times: a tenant's long requests never hold another's short one),
        or admission stops at it."""
        if not self.running and not admitted_any and need > self.kv.capacity_for_one:
            self._fail_too_large(req, need)
            return True
        if req.num_passed >= self.config.admission_patience:
            return False  # passed often enough: no later request starts before it
        blocked.add(owner_of(req.namespace))  # its owner's later requests wait behind it
        held.append(req)  # counted as passed by each request admitted after it
        return True

    def _holds_back(self, req: Req, need: int, reserved: int, flight: _InFlight) -> bool:
        """Graph eviction: whether `req` waits so that work in flight keeps its KV (Belady's
        victim would be what a running request leaves behind once done; the cyclic case).
        - New work (it computes more than it reads from the cache) waits unless free and
          unwanted KV cover it and what the work in flight will still add (future_tokens);
        - a request that mostly reads the cache waits only if it would evict more KV that
          others read soon (waiting requests, branches back right away) than it reads.
        It never waits with nothing running, nor once `admission_patience` requests passed it."""
        if not self.running or req.num_passed >= self.config.admission_patience:
            return False
        reads = req.match_pos.prefix_len
        new_work = req.num_tokens - reads > reads
        # room for the work in flight to finish, this request's own later turns included
        room = need + (flight.future_tokens(req) if new_work else 0)
        if room <= self.kv.allocator.num_free_slots - reserved:
            return False
        unwanted = flight.unwanted_slots(reserved)
        if room - unwanted <= (0 if new_work else reads):
            return False
        self.counters["admissions_held"] += 1
        return True

    def _start(self, req: Req, position) -> None:
        req.status = ReqStatus.RUNNING
        self._admit_seq += 1
        req.admit_seq = self._admit_seq
        req.num_loaded = 0
        cached = self.kv.take_prefix(req, position)
        if req.cached_tokens is None:  # at first admission: not computed (cached or loaded)
            req.cached_tokens, req.loaded_tokens = req.num_computed, req.num_loaded
        self.counters["cached_tokens"] += cached

    def _queued_positions(self):
        """Waiting requests' current matches in admission order (graph eviction's future)."""
        return (self.policy.match(r) for r in self.policy.order(list(self.waiting.values())))

    # ------------------------------------------------------------------ memory
    def _reserved_slots(self, req: Req) -> int:
        return max(0, req.num_tokens - req.capacity) + self._growth_reserve(req)

    def _growth_reserve(self, req: Req) -> int:
        if req.kind is not ReqKind.GENERATE:
            return 0
        return math.ceil(req.remaining_new_tokens * self.new_token_ratio)

    def _ensure_decode_slots(self) -> None:
        """Give every decoding request a slot for this step, retracting others if needed."""
        page_size = self.config.page_size
        while True:
            needy = [r for r in self.running if r.is_decoding and r.capacity < r.num_tokens]
            pages = sum(-(-(r.num_tokens - r.capacity) // page_size) for r in needy)
            if self.kv.make_room(pages * page_size):
                for req in needy:
                    self.kv.grow(req, req.num_tokens)
                return
            if len(self.running) == 1:
                self._fail_too_large(self.running[0], self.running[0].num_tokens + 1)
                return
            self.retract(max(self.running, key=lambda r: r.admit_seq))  # latest admitted first

    def retract(self, req: Req) -> None:
        """Back to waiting, keeping its computed KV in the tree (unlocked) for its return;
        growth was underestimated: reserve more from now on."""
        self._back_to_waiting(req)
        self.counters["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def _back_to_waiting(self, req: Req) -> None:
        self.running.remove(req)
        self.kv.release(req, insert=True)
        req.num_retractions += 1
        req.match_pos = None  # its tokens changed since the last match
        self.add(req)

    def _keep_shares(self) -> None:
        """Before the step: retract requests of owners over their share of the pool when
        another owner's first waiting request, within its share, does not fit (shares.py)."""
        if not self.waiting or not self.running:
            return
        reserved = sum(map(self._reserved_slots, self.running))
        victims = fair_share_victims(
            self.running,
            list(self.waiting.values()),
            self.kv.allocator.num_slots,
            claim_of=lambda r: r.num_tokens + self._growth_reserve(r),
            need_of=self._need,
            available_slots=self.kv.available_slots(reserved),
        )
        for req in victims:
            self._back_to_waiting(req)
            self.counters["share_retractions"] += 1

    def _need(self, req: Req) -> int:
        """Slots admitting `req` promises: what it computes and reserves to grow."""
        return req.num_tokens - self.policy.match(req).prefix_len + self._growth_reserve(req)

    def _fail_too_large(self, req: Req, need: int) -> None:
        pool, held = self.kv.allocator.num_slots, self.kv.cache.protected_size
        if need <= pool:  # it fits an empty pool: pins and running prefixes are in the way
            message = f"request needs {need} KV slots; {held} of {pool} are held: retry later"
            self.fail(req, message, kind="busy")
            return
        self.fail(req, f"request needs {need} KV slots, the pool has {pool}: raise max_kv_tokens")

    # ------------------------------------------------------------------ process
    def process(self, batch: ScheduledBatch, outcomes: Sequence[EntryOutcome]) -> None:
        """Apply one step's outcomes (verify.apply_logits: tokens already sampled into each
        request's output): KV bookkeeping, counts, finishing. One outcome per entry."""
        for entry, outcome in zip(batch.entries, outcomes, strict=True):
            req = entry.req
            start = req.num_computed
            req.num_computed += entry.num_new + outcome.num_accepted
            if entry.draft:
                self.drafter.verified(req, len(entry.draft), outcome.num_accepted)
                self.kv.trim(req)  # the rejected guesses' slots
            prompt_part = max(0, min(req.num_computed, len(req.prompt_ids)) - start)
            self.counters["prefill_tokens"] += prompt_part  # prompt positions
            self.counters["decode_tokens"] += req.num_computed - start - prompt_part
            if outcome.prompt_logits is not None:  # the row after a whole prompt or pin
                self.prompt_logits.keep(req, outcome.prompt_logits)
            if not outcome.at_end:
                self.kv.cache_prefix(req)  # a finished chunk: let others match it now
            elif req.kind is ReqKind.GENERATE:
                if entry.reuses_logits:
                    self.prompt_logits.used(req)
                elif not entry.is_decode:
                    self.kv.cache_prefix(req)
                self._sampled(req, outcome)
            else:
                self._complete(req)
        ratio = self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, ratio)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's forward + sample/verify time: pure decode steps teach the drafter what
        guessed tokens cost."""
        if self.drafter is None or not all(e.is_decode for e in batch.entries):
            return
        extra = sum(len(e.draft) + e.num_new - 1 for e in batch.entries)
        self.drafter.costs.observe(len(batch.entries), extra, seconds)

    def _sampled(self, req: Req, outcome: EntryOutcome) -> None:
        if outcome.error is not None:
            self.fail(req, outcome.error, kind=outcome.error_kind)
            return
        self.counters["jump_forward_tokens"] += outcome.num_forced
        if req.first_token_s is None:
            req.first_token_s = time.monotonic()
        _notify(req.on_delta, req)
        if req.gen.finished:
            self._finish(req, req.gen.finish_reason)
            return
        if req.gen.checking_stops:
            self._checking[req.rid] = req
        self.grammar.start(req)  # its next mask, filled while this step ends

    def _complete(self, req: Req) -> None:
        """A prefill-only request or pin whose tokens are all computed (or were cached)."""
        if req.kind is not ReqKind.PIN:
            self._finish(req, "length")
            return
        if req in self.running:
            self.running.remove(req)
        self.kv.keep_locked_prefix(req)
        req.status = ReqStatus.PINNED
        self.pins[req.rid] = req
        _notify(req.on_finish, req)

    def _finish(self, req: Req, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        self._checking.pop(req.rid, None)
        self.kv.release(req, insert=reason != "error")
        self.grammar.ended(req)
        req.gen.finish(reason)
        req.status = ReqStatus.FINISHED
        self.counters[{"abort": "aborted", "error": "errors"}.get(reason, "finished")] += 1
        _notify(req.on_finish, req)

    def fail(self, req: Req, message: str, reason: str = "error", kind: str = "invalid") -> None:
        """End one request (waiting or running) with `message`; all it held is released.
        `kind` says whose fault it is: the request's, momentary load ("busy"), or ours."""
        self.waiting.pop(req.rid, None)
        req.error, req.error_kind = message, kind
        self._finish(req, reason)

    def fail_running(self, message: str) -> None:
        """After an exception in a step: fail the running requests, keep serving the rest."""
        for req in list(self.running):
            self.fail(req, message, kind="internal")

    # ------------------------------------------------------------------ stats, checks
    def stats(self) -> dict[str, float]:
        """Counters and gauges, Prometheus-style names."""
        c, cache = self.counters, self.kv.cache
        computed, cached = c["prefill_tokens"], c["cached_tokens"]
        return {
            "prefill_tokens_total": computed,
            "decode_tokens_total": c["decode_tokens"],
            "cached_tokens_total": cached,
            "cache_hit_rate": cached / (cached + computed) if cached + computed else 0.0,
            "evicted_tokens_total": cache.num_evicted_tokens,
            "retractions_total": c["retractions"],
            "share_retractions_total": c["share_retractions"],
            "prefill_waits_total": c["prefill_waits"],
            "disk_waits_total": c["disk_waits"],
            "admissions_held_total": c["admissions_held"],
            "requests_finished_total": c["finished"],
            "requests_aborted_total": c["aborted"],
            "requests_failed_total": c["errors"],
            "steps_total": c["steps"],
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_pins": len(self.pins),
            "kv_slots_total": self.kv.allocator.num_slots,
            "kv_slots_used": self.kv.allocator.num_used_slots,
            "kv_slots_peak": c["peak_used_slots"],
            "cache_tokens": cache.total_size,
            "cache_evictable_tokens": cache.evictable_size,
            "cache_protected_tokens": cache.protected_size,
            "cache_wanted_tokens": cache.wanted_size,
            "cache_nodes": cache.num_nodes,
            "schedule_rematches_total": self.policy.num_rematches,
            "new_token_ratio": self.new_token_ratio,
            "jump_forward_tokens_total": c["jump_forward_tokens"],
            **self.grammar.stats(),
            **self.prompt_logits.stats(),
            **(self.drafter or Drafter(1, None)).stats(),  # zeros when speculation is off
            **(self.kv.tiers.stats() if self.kv.tiers is not None else {}),
        }

    def check_integrity(self) -> None:
        """Assert slot conservation and every request's KV bookkeeping."""
        for req in self.waiting.values():
            assert req.capacity == 0 and req.lock_pos is None, f"waiting {req} holds KV"
        self.kv.check_integrity([*self.running, *self.pins.values()])
        self.prompt_logits.check_integrity()


class _InFlight:
    """One admission pass's view of the work in flight (graph eviction), taken on first need:
    per owner, the tokens paused and running programs will still add and the tokens running
    requests hold; and fresh queued-read marks."""

    def __init__(self, kv: KVManager, running: list[Req]) -> None:
        self.kv = kv
        self.running = running
        self._hinted: Counter | None = None
        self._held: Counter = Counter()
        self._marked = False

    def future_tokens(self, req: Req) -> int:
        """The room `req` leaves for work in flight, its own later turns included. A hint is
        advice, never a reservation: each owner's hints count up to its share of the pool
        (the pool split evenly among the owners with work in flight and `req`'s) less what
        its running requests hold, so no owner's hints hold another's requests beyond it."""
        if self._hinted is None:
            self._hinted = self.kv.in_flight_tokens(self.running)
            for running in self.running:
                self._held[owner_of(running.namespace)] += running.num_tokens
        mine = owner_of(req.namespace)
        own = future_tokens(req, self.kv.allocator.num_slots)
        owners = {*self._hinted, *self._held, mine}
        share = self.kv.allocator.num_slots // len(owners)
        total = 0
        for owner in owners:
            hinted = self._hinted.get(owner, 0) + (own if owner == mine else 0)
            total += min(hinted, max(0, share - self._held.get(owner, 0)))
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


def _notify(callback: Callable[[Req], None] | None, req: Req) -> None:
    """Call a caller's callback; one that raises is reported and never stops the engine."""
    if callback is None:
        return
    try:
        callback(req)
    except Exception:  # noqa: BLE001 - the caller's bug, not the scheduler's state
        traceback.print_exc(file=sys.stderr)


def _decode_entry(req: Req, budget: int) -> BatchEntry:
    """A decoding request's part of a step: the token it sampled, or after a jump-forward the
    forced tokens, at most the step's remaining prefill `budget` of them beyond one, so a long
    forced string is computed in chunks (one pass of thousands of tokens would hold every
    other request's step); it samples once they are all computed."""
    num_left = req.num_tokens - req.num_computed
    num_new = min(num_left, 1 + max(0, budget - 1))
    return BatchEntry(req, num_new, True, False, num_new == num_left)


def _prefill_entry(req: Req, num_new: int, pin_row: bool) -> BatchEntry:
    end = req.num_computed + num_new
    wants = end > req.first_logit_pos and (end == req.num_tokens or req.logprob_start is not None)
    if pin_row and req.kind is ReqKind.PIN and end == req.num_tokens:
        wants = True  # the row after a pinned prefix, kept for branches that gen right there
    return BatchEntry(req, num_new, False, wants and req.logprob_start is not None, wants)
