"""The scheduler: admission on the radix cache, mixed batches, retraction, postprocessing.

One step = schedule (decodes of every running request, then prefill chunks of running and newly
admitted requests up to the token budget) -> one forward -> process (sample, stop, insert into
the tree, release). Everything here runs on the engine's loop thread.

Prefill once, exactly: a waiting request is not admitted while a running request is computing
(or holds, not yet inserted) tokens it shares beyond its own cache match; it waits for their
insertion, which happens after every prefill chunk. So each uncached token range is computed
by one request only, and a cold batch computes exactly its union prefix tree.

Memory pressure: when decodes cannot get slots even after eviction, the latest admitted
requests are retracted: their computed KV goes into the tree unlocked (not dropped), they go
back to the front of the queue, and on resumption reuse whatever survived eviction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache
from runtime.model.batch import ForwardBatch
from runtime.model.runner import ModelRunner
from runtime.model.sampler import sample
from runtime.scheduler.policy import SchedulePolicy
from runtime.scheduler.request import Req, ReqKind, ReqStatus

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens reserved for running requests' growth
MIN_NEW_TOKEN_RATIO = 0.15
NEW_TOKEN_RATIO_DECAY = 0.005  # per step, while nothing is retracted


@dataclass
class _Entry:
    req: Req
    num_new: int
    is_decode: bool
    all_logits: bool  # logits at every new position (prompt logprobs)
    wants_logits: bool  # logits at the last new position at least


class OutOfMemoryForRequest(RuntimeError):
    """A request needs more KV slots than the pool can ever give it."""


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        page_size: int,
        schedule_policy: str,
        eviction_policy: str,
        disable_radix_cache: bool,
        chunked_prefill_tokens: int,
        max_running_requests: int,
        seed: int = 0,
        record_trace: bool = False,
        jump_forward: bool = True,
    ) -> None:
        self.runner = runner
        self.page_size = page_size
        self.allocator = SlotAllocator(runner.pool.num_slots, page_size)
        self.cache = (
            None if disable_radix_cache else RadixCache(self.allocator, page_size, eviction_policy)
        )
        self.policy = SchedulePolicy(schedule_policy, self.cache, seed)
        self.graph_eviction = self.cache is not None and eviction_policy == "graph"
        self.trace: list[tuple] | None = [] if record_trace else None
        self.jump_forward = jump_forward
        self._future_marked: list = []
        self.chunked_prefill_tokens = chunked_prefill_tokens
        self.max_running_requests = max_running_requests
        self.waiting: dict[str, Req] = {}
        self.running: list[Req] = []
        self.pins: dict[str, Req] = {}
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._admit_seq = 0
        self.counters = dict.fromkeys(
            (
                "prefill_tokens",
                "decode_tokens",
                "cached_tokens",
                "retractions",
                "finished",
                "aborted",
                "errors",
                "steps",
                "peak_used_slots",
                "prefill_waits",
                "jump_forward_tokens",
            ),
            0,
        )

    # ------------------------------------------------------------------ intake
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting[req.rid] = req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: str) -> bool:
        """Stop a waiting or running request, or release a pin; False if unknown."""
        if rid in self.waiting:
            self._finish(self.waiting.pop(rid), "abort")
            return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, "abort")
                return True
        if rid in self.pins:
            self.unpin(rid)
            return True
        return False

    def unpin(self, pin_id: str) -> None:
        req = self.pins.pop(pin_id)
        if req.lock_pos is not None:
            self.cache.unlock(req.lock_pos)
        self._free(req.slots[req.num_locked :])
        req.reset_kv()
        req.status = ReqStatus.FINISHED

    def flush_cache(self) -> int:
        """Evict every unlocked cached token; return how many."""
        if self.cache is None:
            return 0
        return self.cache.evict(self.cache.evictable_size)

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """Schedule, run and process one batch; False when there was nothing to run."""
        entries = self._schedule()
        if not entries:
            return False
        self.counters["steps"] += 1
        used = self.allocator.num_used_slots
        self.counters["peak_used_slots"] = max(self.counters["peak_used_slots"], used)
        batch = ForwardBatch.build(
            [e.req.tokens(e.req.num_computed, e.req.num_computed + e.num_new) for e in entries],
            [e.req.slots[: e.req.num_computed + e.num_new] for e in entries],
            all_logits=[e.all_logits for e in entries],
            no_logits=[not e.wants_logits for e in entries],
        )
        logits = self.runner.forward(batch)
        self._process(entries, logits)
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        return True

    def fail_all_running(self, message: str) -> None:
        """After an exception in a step: fail the running requests, keep serving the rest."""
        for req in list(self.running):
            req.error = message
            self._finish(req, "error")

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> list[_Entry]:
        while True:
            self._ensure_decode_slots()
            entries = [
                _Entry(r, r.num_tokens - r.num_computed, True, False, True)
                for r in self.running
                if r.is_decoding
            ]
            budget = self.chunked_prefill_tokens
            for req in [r for r in self.running if not r.is_decoding]:
                num_new = min(req.num_tokens - req.num_computed, budget)
                if num_new <= 0 or not self._grow(req, req.num_computed + num_new):
                    break
                entries.append(self._prefill_entry(req, num_new))
                budget -= num_new
            if budget > 0 and self.waiting and len(self.running) < self.max_running_requests:
                entries += self._admit(budget)
            if entries or not self.running:
                return entries
            # only prefills that cannot get memory: make room by retracting, or fail the last
            if len(self.running) == 1:
                (req,) = self.running
                self._fail_too_large(req, req.num_tokens)
            else:
                self.retract(max(self.running, key=lambda r: r.admit_seq))

    def _admit(self, budget: int) -> list[_Entry]:
        entries = []
        available = self._available_slots()
        for req in self.policy.order(list(self.waiting.values())):
            if budget <= 0 or len(self.running) >= self.max_running_requests:
                break
            match = None
            cached = 0
            if self.cache is not None:
                match = self.cache.match_prefix(req.all_ids[: req.match_limit], req.namespace)
                cached = match.prefix_len
                if self._waits_for_inflight(req, cached):
                    self.counters["prefill_waits"] += 1
                    continue
            need = req.num_tokens - cached + self._growth_reserve(req)
            if need > available:
                if not self.running and not entries and need > self._capacity_for_one():
                    self._fail_too_large(req, need)
                    continue
                break
            del self.waiting[req.rid]
            self._start(req, match)
            available -= need
            num_new = min(req.num_tokens - req.num_computed, budget)
            if num_new == 0:  # everything cached and no logits needed
                self._complete(req)
                continue
            if not self._grow(req, req.num_computed + num_new):
                self._requeue(req)  # eviction could not produce the slots: try next step
                break
            self.running.append(req)
            entries.append(self._prefill_entry(req, num_new))
            budget -= num_new
        return entries

    def _start(self, req: Req, match) -> None:
        """Lock the matched prefix and take its slots; the request becomes running."""
        req.status = ReqStatus.RUNNING
        self._admit_seq += 1
        req.admit_seq = self._admit_seq
        cached = match.prefix_len if match is not None else 0
        if cached:
            self.cache.lock(match.last_node)
            if self.graph_eviction:  # read now: no longer a pending continuation
                self.cache.resolve(match.last_node).future_base = None
            req.lock_pos = match.last_node
            req.slots = match.indices.clone()
        req.num_computed = req.num_locked = cached
        if self.trace is not None:
            self.trace.append(("access", req.namespace, tuple(req.all_ids), req.match_limit))
        if req.cached_tokens is None:
            req.cached_tokens = cached
        self.counters["cached_tokens"] += cached

    def _requeue(self, req: Req) -> None:
        self.counters["cached_tokens"] -= req.num_locked
        self._release(req, insert=False)
        req.status = ReqStatus.WAITING
        self.waiting[req.rid] = req

    def _prefill_entry(self, req: Req, num_new: int) -> _Entry:
        end = req.num_computed + num_new
        wants = end > req.first_logit_pos and (
            end == req.num_tokens or req.logprob_start is not None
        )
        all_logits = wants and req.logprob_start is not None
        return _Entry(req, num_new, False, all_logits, wants)

    def _waits_for_inflight(self, req: Req, cached: int) -> bool:
        """Whether a running request computes (or holds uninserted) tokens `req` shares beyond
        its cache match: then `req` waits for their insertion instead of computing them again."""
        ids = req.all_ids
        limit = req.match_limit
        end = min(limit, cached + self.page_size)
        if end - cached < self.page_size:
            return False  # no whole page beyond the match to share
        for other in self.running:
            if other.namespace != req.namespace or other.num_tokens < end:
                continue
            if (
                other.tokens(cached, end) == ids[cached:end]
                and other.tokens(0, cached) == ids[:cached]
            ):
                return True
        return False

    # ------------------------------------------------------------------ memory
    def _available_slots(self) -> int:
        """Slots admission may promise: free + evictable - what running requests still need."""
        evictable = self.cache.evictable_size if self.cache is not None else 0
        reserved = sum(
            max(0, r.num_tokens - r.capacity) + self._growth_reserve(r) for r in self.running
        )
        return self.allocator.num_free_slots + evictable - reserved

    def _growth_reserve(self, req: Req) -> int:
        if req.kind is not ReqKind.GENERATE:
            return 0
        return math.ceil(req.remaining_new_tokens * self.new_token_ratio)

    def _capacity_for_one(self) -> int:
        protected = self.cache.protected_size if self.cache is not None else 0
        return self.allocator.num_slots - protected

    def _grow(self, req: Req, upto: int) -> bool:
        """Make req.slots cover `upto` tokens (whole pages), evicting if needed."""
        short = upto - req.capacity
        if short <= 0:
            return True
        num_tokens = -(-short // self.page_size) * self.page_size
        if not self._make_room(num_tokens):
            return False
        req.slots = torch.cat([req.slots, self.allocator.alloc(num_tokens)])
        return True

    def _make_room(self, num_tokens: int) -> bool:
        missing = num_tokens - self.allocator.num_free_slots
        if missing > 0 and self.cache is not None:
            if self.graph_eviction:
                self._mark_queued_reads()
            self.cache.evict(missing)
        return self.allocator.num_free_slots >= num_tokens

    def _mark_queued_reads(self) -> None:
        """ "graph" eviction: every node on a waiting request's matched path gets the rank of
        the earliest waiting request that reads it (so a path is not evicted from the bottom
        up into class "no reader" the moment its leaf goes)."""
        for node in self._future_marked:  # last pass's marks are stale now
            node.future = node.future_base
            self.cache.reprioritize(node)
        self._future_marked = []
        for rank, req in enumerate(self.policy.order(list(self.waiting.values()))):
            self.policy.refresh_match(req)
            node = req.match_pos.node
            mark = (2, -rank)
            while node.parent is not None and not node.evicted:
                if node.future is not None and node.future >= mark:
                    break  # an earlier request marked this node and its ancestors already
                node.future = mark
                self._future_marked.append(node)
                self.cache.reprioritize(node)
                node = node.parent

    def _mark_continuation(self, req: Req) -> None:
        """ "graph" eviction: the program will extend this sequence soon (its whole path)."""
        if not (self.graph_eviction and req.hints.continuation and req.lock_pos is not None):
            return
        mark = (1, -self.counters["steps"])
        node = self.cache.resolve(req.lock_pos)
        while node.parent is not None and (node.future is None or node.future[0] == 1):
            node.future_base = node.future = mark
            node = node.parent

    def _ensure_decode_slots(self) -> None:
        """Give every decoding request a slot for this step, retracting others if needed."""
        while True:
            needy = [r for r in self.running if r.is_decoding and r.capacity < r.num_tokens]
            pages = [-(-(r.num_tokens - r.capacity) // self.page_size) for r in needy]
            if self._make_room(sum(pages) * self.page_size):
                for req in needy:
                    self._grow(req, req.num_tokens)
                return
            if len(self.running) == 1:
                (req,) = self.running
                self._fail_too_large(req, req.num_tokens + 1)
                return
            victim = max(self.running, key=lambda r: r.admit_seq)  # latest admitted first
            self.retract(victim)

    def retract(self, req: Req) -> None:
        """Back to waiting, keeping its computed KV in the tree (unlocked) for its return."""
        self.running.remove(req)
        self._release(req, insert=True)
        req.num_retractions += 1
        req.status = ReqStatus.WAITING
        req.match_pos = None
        self.waiting[req.rid] = req
        self.counters["retractions"] += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    def _fail_too_large(self, req: Req, need: int) -> None:
        self.waiting.pop(req.rid, None)
        pool = self.allocator.num_slots
        pinned = self.cache.protected_size if self.cache is not None else 0
        req.error = (
            f"request needs {need} KV slots but the pool has {pool} "
            f"({pinned} held by pins and running prefixes); raise max_kv_tokens"
        )
        self._finish(req, "error")

    # ------------------------------------------------------------------ processing
    def _process(self, entries: list[_Entry], logits: torch.Tensor) -> None:
        row = 0
        to_sample: list[tuple[Req, int]] = []
        for entry in entries:
            req = entry.req
            num_rows = entry.num_new if entry.all_logits else int(entry.wants_logits)
            first_row, row = row, row + num_rows
            start = req.num_computed
            req.num_computed += entry.num_new
            prompt_part = max(0, min(req.num_computed, len(req.prompt_ids)) - start)
            self.counters["prefill_tokens"] += prompt_part  # prompt positions
            self.counters["decode_tokens"] += entry.num_new - prompt_part  # generated ones
            if entry.all_logits:
                self._record_prompt_logprobs(req, start, logits[first_row:row])
            if req.num_computed < req.num_tokens:
                self._cache_prefix(req)  # a finished chunk: let others match it now
                continue
            if req.kind is ReqKind.GENERATE:
                if not entry.is_decode:
                    self._cache_prefix(req)
                to_sample.append((req, row - 1))
            else:
                if req.keep_last_logprobs:
                    req.last_logprobs = torch.log_softmax(logits[row - 1], dim=-1)
                self._complete(req)
        if to_sample:
            reqs = [r for r, _ in to_sample]
            out = sample(logits[[i for _, i in to_sample]], [r.gen for r in reqs])
            for i, req in enumerate(reqs):
                req.gen.append(out.token_ids[i], out.logprobs[i], out.top_logprobs[i])
                if req.gen.constraint is not None and self.jump_forward:
                    self._jump_forward(req)
                if req.on_delta:
                    req.on_delta(req)
                if req.gen.finished:
                    self._finish(req, req.gen.finish_reason)

    def _jump_forward(self, req: Req) -> None:
        """Append what the grammar forces next; the next step computes it as one extend."""
        gen = req.gen
        if gen.finished:
            return
        forced = gen.constraint.jump_forward()
        for token_id in forced:
            gen.append(token_id, forced=True)
            self.counters["jump_forward_tokens"] += 1
            if gen.finished:
                break

    def _record_prompt_logprobs(self, req: Req, start: int, rows: torch.Tensor) -> None:
        """rows[i] are the logits at position start + i, predicting token start + i + 1."""
        logprobs = torch.log_softmax(rows, dim=-1)
        for i in range(rows.shape[0]):
            j = start + i + 1
            if req.logprob_start <= j < len(req.prompt_ids):
                req.prompt_logprobs[j] = float(logprobs[i, req.prompt_ids[j]])

    def _complete(self, req: Req) -> None:
        """A prefill-only request or pin whose tokens are all computed (or were cached)."""
        if req.kind is ReqKind.PIN:
            if req in self.running:
                self.running.remove(req)
            self._cache_prefix(req)
            self._free(req.slots[req.num_locked :])  # a partial last page cannot be shared
            req.slots = req.slots[: req.num_locked].clone()
            req.status = ReqStatus.PINNED
            self.pins[req.rid] = req
            if req.on_finish:
                req.on_finish(req)
        else:
            self._finish(req, "length")

    def _finish(self, req: Req, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        self._release(req, insert=reason != "error")
        req.gen.finish(reason)
        req.status = ReqStatus.FINISHED
        key = {"abort": "aborted", "error": "errors"}.get(reason, "finished")
        self.counters[key] += 1
        if req.on_finish:
            req.on_finish(req)

    # ------------------------------------------------------------------ tree bookkeeping
    def _cache_prefix(self, req: Req) -> None:
        """Insert the computed tokens into the tree and move the request's lock down to them.

        Slots of tokens someone else inserted meanwhile are duplicates: they are freed and
        replaced by the tree's, so the request always reads the canonical copy.
        """
        if self.cache is None:
            return
        n = req.num_computed
        aligned = n // self.page_size * self.page_size
        if aligned <= req.num_locked:
            return
        ids = req.all_ids[:n]
        prefix_len = self.cache.insert(ids, req.slots[:n], req.namespace, req.hints.priority)
        if self.trace is not None:
            self.trace.append(("insert", req.namespace, tuple(ids[:aligned])))
        if prefix_len > req.num_locked:
            self._free(req.slots[req.num_locked : prefix_len])
        match = self.cache.match_prefix(ids[:aligned], req.namespace)
        self.cache.lock(match.last_node)
        if req.lock_pos is not None:
            self.cache.unlock(req.lock_pos)
        req.slots[:aligned] = match.indices
        req.lock_pos = match.last_node
        req.num_locked = aligned

    def _release(self, req: Req, insert: bool) -> None:
        """Give up the request's KV: into the tree (insert) or back to the allocator."""
        if self.cache is not None and insert:
            self._cache_prefix(req)
            self._mark_continuation(req)
        if req.lock_pos is not None:
            self.cache.unlock(req.lock_pos)
        self._free(req.slots[req.num_locked :])
        req.reset_kv()

    def _free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    # ------------------------------------------------------------------ checks
    def num_owned_slots(self) -> int:
        """Slots held by requests outside the tree."""
        return sum(r.capacity - r.num_locked for r in self.running) + sum(
            r.capacity - r.num_locked for r in self.pins.values()
        )

    def check_integrity(self) -> None:
        """Assert slot conservation and every request's KV bookkeeping."""
        for req in self.waiting.values():
            assert req.capacity == 0 and req.lock_pos is None, f"waiting {req} holds KV"
        for req in [*self.running, *self.pins.values()]:
            assert req.num_locked <= req.num_computed <= req.capacity, req
            assert req.num_locked % self.page_size == 0, req
            if req.num_locked:
                match = self.cache.match_prefix(req.all_ids[: req.num_locked], req.namespace)
                assert match.prefix_len == req.num_locked, f"{req}: locked prefix left the tree"
                assert torch.equal(match.indices, req.slots[: req.num_locked]), req
        if self.cache is not None:
            self.cache.check_integrity(num_caller_slots=self.num_owned_slots())
        else:
            self.allocator.check_integrity()
            owned = self.num_owned_slots()
            assert self.allocator.num_free_slots + owned == self.allocator.num_slots
