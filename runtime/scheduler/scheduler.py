"""The scheduler decides: which requests run next and how much of each; it never runs the model.

`schedule()` builds one mixed batch: decodes of every running request, then prefill chunks of
running and newly admitted requests up to the token budget, the best-ranked program's first, and
the ones ranked below it in short steps while it runs (step_ranks.py; a constrained request
decodes, or is admitted, once its grammar mask is ready: grammar_gate.py).
`process(batch, logits)` applies a forward pass's logits: counts, prompt logprobs, sampling, stop
rules, inserting computed KV into the tree, finishing. It needs slot counts and logits only, so
it is tested with fake logits. Everything here runs on the engine's loop thread.

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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from runtime.cache.lower import NO_TIERS, LowerTiers
from runtime.cache.nodes import TreePosition
from runtime.config import EngineConfig
from runtime.generation import StopBudget
from runtime.scheduler.admission import admit, fail_too_large
from runtime.scheduler.drafts import make_drafter
from runtime.scheduler.entries import (
    BatchEntry,
    ScheduledBatch,
    batch_of,
    decode_entries,
    prefill_entry,
)
from runtime.scheduler.grammar_gate import GrammarGate
from runtime.scheduler.kv import build_kv
from runtime.scheduler.lookahead import Lookahead
from runtime.scheduler.prompt_logits import PromptLogits
from runtime.scheduler.request import Req, ReqKind, ReqStatus
from runtime.scheduler.shares import OwnerActivity, fair_share_victims_of, step_tokens
from runtime.scheduler.stats import scheduler_stats
from runtime.scheduler.step_ranks import StepRanks
from runtime.scheduler.step_time import IdleTime, StepTime

if TYPE_CHECKING:
    from runtime.verify import EntryOutcome

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens reserved for running requests' growth
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.005  # per step, while nothing is retracted


TIMEOUT_MESSAGE = "the request's timeout passed before it finished"


class Scheduler:
    """Admission on the prefix cache, mixed batches, retraction, output processing."""

    def __init__(self, config: EngineConfig, num_slots: int, tiers: LowerTiers = NO_TIERS) -> None:
        self.config = config
        self.waiting: dict[str, Req] = {}
        self.running: list[Req] = []
        self.pins: dict[str, Req] = {}
        self.kv, self.policy = build_kv(config, num_slots, tiers, self.waiting)
        self.step_time = StepTime()  # what a computed token costs: shared steps' length
        self.idle = IdleTime()  # time between steps: compute a waiting request could have had
        self.lookahead = Lookahead(self.kv, self.step_time, self.idle, config)
        self.activity = OwnerActivity()
        shares = self.kv.cache.can_share  # (a row is used with a whole-prompt hit)
        self.prompt_logits = PromptLogits(config.reuse_prompt_logits if shares else 0)
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.counters: Counter[str] = Counter()
        self._admit_seq = 0
        self._deadlines: list[tuple[float, int, Req]] = []  # heap: soonest first
        self._checking: dict[str, Req] = {}  # stop_regex matching behind: catching up
        self.grammar = GrammarGate(config.grammar_step_budget_ms, config.grammar_mask_threads)
        self.drafter = make_drafter(config, self.kv.token_index)
        self._step_budget = config.chunked_prefill_tokens  # this step's tokens (step_tokens)

    # ------------------------------------------------------------------ intake
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        req.queue.idle_at_arrival_s = self.idle.total_s()
        self.waiting[req.rid] = req
        self.lookahead.arrived(req)
        self.activity.saw(req)
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
            self.release(pin, insert=False)
            pin.status = ReqStatus.FINISHED
        return pin is not None

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch | None:
        """The next batch, with every slot it writes allocated; None if nothing can run."""
        self.idle.step_started()  # (a step ends with `process`)
        self.lookahead.read_clock()
        self._abort_expired()
        self.lookahead.prefetch(self.kv.queued_reads.matches())  # (read lazily: a few at most)
        self.grammar.prepare([r for r in self.running if r.is_decoding])
        stop_budget = StopBudget()  # one for the step: catching up and sampling share it
        self._catch_up_stops(stop_budget)
        for req in fair_share_victims_of(self):  # owners over their share make room
            self.back_to_waiting(req)
            req.queue.yielded = True
            self.counters["share_retractions"] += 1
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
        return batch_of(entries, self._step_budget)

    def _schedule_entries(self) -> list[BatchEntry]:
        while True:
            self._ensure_decode_slots()
            decoding = [r for r in self.running if r.is_decoding]
            prefilling = [r for r in self.running if not r.is_decoding]
            budget, shared = step_tokens(self)
            self._step_budget = budget
            ranks = StepRanks(self)  # a better-ranked program running: short steps for the rest
            # owners taking turns: waiting requests start before running ones take the budget
            entries = admit(self, ranks.admission_budget(budget)) if shared else []
            ranks.admitted(entries)
            budget -= sum(e.num_new for e in entries)
            # else: stop matching is behind (_catch_up_stops), or its mask is not ready
            ready = [r for r in decoding if not r.gen.checking_stops and self.grammar.can_sample(r)]
            decodes, budget = decode_entries(ready, budget)
            num_deferred = len(decoding) - len(decodes)
            if len(decodes) <= self.config.spec_max_batch:
                decodes = self.drafter.attach(decodes, self.running, self.grammar, self.kv)
            entries += decodes
            for req in ranks.order(prefilling):
                num_new = min(req.num_tokens - req.kv.num_computed, ranks.room(req, budget))
                if num_new <= 0 or not self.kv.grow(req, req.kv.num_computed + num_new):
                    break
                entries.append(prefill_entry(req, num_new, self.prompt_logits.max_rows > 0))
                ranks.took(req, num_new)
                budget -= num_new
            if not shared:
                entries += admit(self, ranks.admission_budget(budget))
            if entries or not self.running or num_deferred:
                return entries  # (none while decodes wait for masks: they will run soon)
            # only prefills that cannot get memory: make room by retracting, or fail the last
            if len(self.running) == 1:
                fail_too_large(self, self.running[0], self.running[0].num_tokens)
            else:
                self.retract(max(self.running, key=lambda r: r.queue.admit_seq))

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

    def start(self, req: Req, position: TreePosition) -> None:
        """Admission: lock its cached prefix (and load what lies below), count the hit."""
        req.status = ReqStatus.RUNNING
        self._admit_seq += 1
        req.queue.admit_seq = self._admit_seq
        req.usage.loaded_now_tokens = 0
        cached = self.kv.take_prefix(req, position)
        if req.usage.cached_tokens is None:  # at first admission: not computed (cached or loaded)
            req.usage.cached_tokens, req.usage.loaded_tokens = (
                req.kv.num_computed,
                req.usage.loaded_now_tokens,
            )
        self.counters["cached_tokens"] += cached

    def unstart(self, req: Req) -> None:
        """Undo `start` (its first chunk could not get slots): back to waiting."""
        self.counters["cached_tokens"] -= req.kv.num_locked - req.usage.loaded_now_tokens
        self.release(req, insert=False)
        self.add(req)

    # ------------------------------------------------------------------ memory
    def release(self, req: Req, insert: bool) -> None:
        """A request gives up its KV: into the tree (insert; a continuing branch is then
        remembered at its path) or back to the pool."""
        if insert:
            self.kv.cache_prefix(req)
            self.lookahead.paused(req)
        self.kv.release(req, insert=False)
        self.lookahead.released(req)

    def reserved_slots(self, req: Req) -> int:
        return max(0, req.num_tokens - req.kv.capacity) + self.growth_reserve(req)

    def growth_reserve(self, req: Req) -> int:
        if req.kind is not ReqKind.GENERATE:
            return 0
        expected = req.hints.expected_output_tokens  # the client's estimate (Dynamo's osl)
        if expected is not None:  # instead of a share of max_new_tokens; retraction if short
            return min(req.remaining_new_tokens, max(0, expected - len(req.gen.output_ids)))
        return math.ceil(req.remaining_new_tokens * self.new_token_ratio)

    def _ensure_decode_slots(self) -> None:
        """Give every decoding request a slot for this step, retracting others if needed."""
        page_size = self.config.page_size
        while True:
            needy = [r for r in self.running if r.is_decoding and r.kv.capacity < r.num_tokens]
            pages = sum(-(-(r.num_tokens - r.kv.capacity) // page_size) for r in needy)
            if self.kv.make_room(pages * page_size):
                for req in needy:
                    self.kv.grow(req, req.num_tokens)
                return
            if len(self.running) == 1:
                fail_too_large(self, self.running[0], self.running[0].num_tokens + 1)
                return
            latest = max(self.running, key=lambda r: r.queue.admit_seq)
            self.retract(latest)  # latest admitted first

    def retract(self, req: Req) -> None:
        """Back to waiting, keeping its computed KV in the tree (unlocked) for its return;
        growth was underestimated: reserve more from now on."""
        self.back_to_waiting(req)
        self.counters["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def back_to_waiting(self, req: Req) -> None:
        self.running.remove(req)
        self.release(req, insert=True)
        req.queue.num_retractions += 1
        req.queue.match_pos = None  # its tokens changed since the last match
        self.add(req)

    def need(self, req: Req) -> int:
        """Slots admitting `req` promises: what it computes and reserves to grow."""
        return req.num_tokens - self.policy.match(req).prefix_len + self.growth_reserve(req)

    # ------------------------------------------------------------------ process
    def process(self, batch: ScheduledBatch, outcomes: Sequence[EntryOutcome]) -> None:
        """Apply one step's outcomes (verify.apply_logits: tokens already sampled into each
        request's output): KV bookkeeping, counts, finishing. One outcome per entry."""
        for entry, outcome in zip(batch.entries, outcomes, strict=True):
            req = entry.req
            start = req.kv.num_computed
            req.kv.num_computed += entry.num_new + outcome.num_accepted
            if entry.draft:
                self.drafter.verified(req, len(entry.draft), outcome.num_accepted)
                self.kv.trim(req)  # the rejected guesses' slots
            prompt_part = max(0, min(req.kv.num_computed, len(req.prompt_ids)) - start)
            self.counters["prefill_tokens"] += prompt_part  # prompt positions
            self.counters["decode_tokens"] += req.kv.num_computed - start - prompt_part
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
                self.complete(req)
        ratio = self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, ratio)
        self.idle.step_ended()

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        self.drafter.observe_step(batch.entries, seconds)
        self.step_time.observe(sum(e.num_new + len(e.draft) for e in batch.entries), seconds)

    def _sampled(self, req: Req, outcome: EntryOutcome) -> None:
        if outcome.error is not None:
            self.fail(req, outcome.error, kind=outcome.error_kind)
            return
        self.counters["jump_forward_tokens"] += outcome.num_forced
        if req.usage.first_token_s is None:
            req.usage.first_token_s = time.monotonic()
        _notify(req.on_delta, req)
        if req.gen.finished:
            self._finish(req, req.gen.finish_reason)
            return
        if req.gen.checking_stops:
            self._checking[req.rid] = req
        self.grammar.start(req)  # its next mask, filled while this step ends

    def complete(self, req: Req) -> None:
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
        self.release(req, insert=reason != "error")
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
        """Counters and gauges, Prometheus-style names (stats.py)."""
        return scheduler_stats(self)

    def check_integrity(self) -> None:
        """Assert slot conservation and every request's KV bookkeeping."""
        for req in self.waiting.values():
            assert req.kv.capacity == 0 and req.kv.lock_pos is None, f"waiting {req} holds KV"
        self.kv.check_integrity(holders := [*self.running, *self.pins.values()])
        self.lookahead.programs.check_integrity(holders)
        self.prompt_logits.check_integrity()


def _notify(callback: Callable[[Req], None] | None, req: Req) -> None:
    """Call a caller's callback; one that raises is reported and never stops the engine."""
    if callback is None:
        return
    try:
        callback(req)
    except Exception:  # noqa: BLE001 - the caller's bug, not the scheduler's state
        traceback.print_exc(file=sys.stderr)
