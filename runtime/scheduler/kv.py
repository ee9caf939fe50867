"""KVManager: the request <-> prefix-cache protocol (who owns which KV slot, and when).

A request's KV, by token index into `req.all_ids`, between two steps:

    0            num_locked            num_computed               capacity
    |--- cached ---|------ computed ------|-------- reserved --------|
    | the tree's   | the request's own    | the request's own,       |
    | slots, locked| slots, written, not  | allocated (whole pages), |
    | at lock_pos  | yet in the tree      | not yet written          |

- admission (`take_prefix`): the matched prefix [0, cached) is locked; its slots are the
  tree's; num_locked = num_computed = cached.
- growth (`grow`): whole pages are appended to `slots`, evicting unlocked leaves if needed.
- after every prefill chunk and at release (`cache_prefix`): [0, aligned) goes into the tree,
  aligned = num_computed rounded down to a page. The tree takes [prefix_len, aligned) of the
  request's slots; [num_locked, prefix_len) had been inserted by someone else meanwhile, so the
  request's copies are duplicates: they are freed and replaced by the tree's. The lock moves
  down to `aligned`. [aligned, num_computed) (a partial page) stays the request's.
- release (`release`): unlock; [num_locked, capacity) goes back to the allocator.

Lower tiers (tiers.py, optional): what eviction takes is demoted to host memory or disk, and
admission continues the device match from there: [cached, cached + loaded) is copied into fresh
slots and inserted, so it is locked like the cached part and never computed.

With `NullCache` (cache disabled) nothing matches and insert takes nothing, so num_locked stays
0 and every slot a request computes is its own until release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.base import PrefixCache
from runtime.cache.factory import PrefixCacheParts, build_prefix_cache
from runtime.cache.lower import NO_TIERS, LowerTiers
from runtime.cache.nodes import TreePosition
from runtime.cache.policy_base import NoMarks
from runtime.config import EngineConfig
from runtime.scheduler.policy import QueuedReads, SchedulePolicy
from runtime.scheduler.request import Req, ReqStatus

HOT_READS = 2  # write_through_selective: a prefix is copied down at its second cache hit


def build_kv(
    config: EngineConfig, num_slots: int, tiers: LowerTiers, waiting: Mapping[str, Req]
) -> tuple[KVManager, SchedulePolicy]:
    """The KV manager over a new pool of `num_slots` slots and the queue's order over its
    cache (`waiting`: the scheduler's queue, whose reads graph eviction's marks look at)."""
    allocator = SlotAllocator(num_slots, config.page_size)
    parts = build_prefix_cache(config, allocator, tiers)
    policy = SchedulePolicy(config.schedule_policy, parts.cache, config.seed)
    return KVManager(config, allocator, parts, QueuedReads(waiting, policy), tiers), policy


class KVManager:
    """Owns the slot allocator, the prefix cache and its eviction marks; moves requests' KV
    between them following the protocol above."""

    def __init__(
        self,
        config: EngineConfig,
        allocator: SlotAllocator,
        parts: PrefixCacheParts,
        queued_reads: QueuedReads,
        tiers: LowerTiers = NO_TIERS,
    ) -> None:
        self.page_size = config.page_size
        self.allocator = allocator
        self.cache: PrefixCache = parts.cache
        self.marks: NoMarks = parts.marks  # what the eviction policy is told of the future
        self.kv_events = parts.kv_events  # the tree's changes, for subscribers
        self.token_index = parts.token_index  # speculative drafts read the tree through it
        self.queued_reads = queued_reads  # the queue's reads, fetched right before evicting
        self.tiers = tiers  # (NoTiers with disable_radix_cache: the engine builds none)
        self.trace: list[tuple] | None = [] if config.record_trace else None

    # ------------------------------------------------------------------ sizes
    def available_slots(self, reserved: int) -> int:
        """Slots admission may promise: free + evictable - what running requests still need."""
        return self.allocator.num_free_slots + self.cache.evictable_size - reserved

    @property
    def capacity_for_one(self) -> int:
        """The most one request could ever hold now: everything not protected."""
        return self.allocator.num_slots - self.cache.protected_size

    def running_computes_shared(self, req: Req, cached: int, running: Sequence[Req]) -> bool:
        """Whether a running request computes (or holds uninserted) tokens `req` shares beyond
        its cache match: then `req` should wait for their insertion, not compute them again."""
        end = min(req.match_limit, cached + self.page_size)
        if not self.cache.can_share or end - cached < self.page_size:
            return False  # nothing inserted can be reused, or no whole page left to share
        ids = req.all_ids
        return any(
            other.namespace == req.namespace
            and other.num_tokens >= end
            and other.tokens(cached, end) == ids[cached:end]
            and other.tokens(0, cached) == ids[:cached]
            for other in running
        )

    # ------------------------------------------------------------------ protocol
    def take_prefix(self, req: Req, position: TreePosition) -> int:
        """Admission: lock the matched prefix up to `position` and adopt its slots, then
        load what the lower tiers hold past it. Returns the device hit (tokens)."""
        cached = position.prefix_len
        if cached:
            self.cache.lock(position)
            self.marks.mark_read(position)
            req.kv.lock_pos = position
            req.kv.slots = self.cache.slot_indices(position).clone()
        req.kv.num_computed = req.kv.num_locked = cached
        if cached and self.tiers.write_policy == "write_through_selective":
            self._back_up_if_hot(req, position)
        self._load_below(req)
        self.marks.mark_access(req.namespace, req.all_ids, req.match_limit)
        if self.trace is not None:
            self.trace.append(("access", req.namespace, tuple(req.all_ids), req.match_limit))
        return cached

    def _back_up_if_hot(self, req: Req, position: TreePosition) -> None:
        """write_through_selective: a prefix that admissions read again and again is hot:
        copy it down now, not only when it is evicted."""
        if self.cache.policy.note_read(self.cache.resolve(position)) == HOT_READS:
            ids = req.tokens(0, req.kv.num_locked)
            self.tiers.store(req.namespace, ids, 0, req.kv.slots, req.kv.chunk_names)

    def _load_below(self, req: Req) -> None:
        """Continue a request's device match from the lower tiers: fresh slots, a copy, an
        insert (so the loaded tokens are locked and shared like cached ones)."""
        ids = req.all_ids
        extent = self.tiers.extent(
            req.namespace, ids, req.kv.num_locked, req.match_limit, req.kv.chunk_names
        )
        room = self.allocator.num_free_slots + self.cache.evictable_size
        extent = extent.within(room)  # what fits now; the rest is computed as before
        if not extent.num_tokens or not self.make_room(extent.num_tokens):
            return
        slots = self.allocator.alloc(extent.num_tokens)
        loaded = self.tiers.load(extent, slots)
        self.free(slots[loaded:])
        if not loaded:
            return
        req.kv.slots = torch.cat([req.kv.slots, slots[:loaded]])
        req.kv.num_computed = req.kv.num_locked + loaded
        req.usage.loaded_now_tokens += loaded
        self.cache_prefix(req)

    def grow(self, req: Req, upto: int, evict: bool = True) -> bool:
        """Make req.kv.slots cover `upto` tokens (whole pages), evicting if needed and allowed
        (a speculative draft takes free slots only)."""
        short = upto - req.kv.capacity
        if short <= 0:
            return True
        num_tokens = -(-short // self.page_size) * self.page_size
        room = self.make_room(num_tokens) if evict else num_tokens <= self.allocator.num_free_slots
        if not room:
            return False
        req.kv.slots = torch.cat([req.kv.slots, self.allocator.alloc(num_tokens)])
        return True

    def trim(self, req: Req) -> None:
        """After a verified draft: keep the pages up to the next token's slot, free the rest
        (the rejected guesses')."""
        keep = -(-(req.kv.num_computed + 1) // self.page_size) * self.page_size
        if req.kv.capacity > keep:
            self.free(req.kv.slots[keep:])
            req.kv.slots = req.kv.slots[:keep]

    def make_room(self, num_tokens: int) -> bool:
        """Evict until `num_tokens` slots are free; False if the unlocked tree is too small."""
        missing = num_tokens - self.allocator.num_free_slots
        if missing > 0:
            self.marks.mark_queued_reads(self.queued_reads.positions)
            self.cache.evict(missing)
        return self.allocator.num_free_slots >= num_tokens

    def cache_prefix(self, req: Req) -> None:
        """Insert the computed whole pages into the tree and move the request's lock down."""
        n = req.kv.num_computed
        aligned = n // self.page_size * self.page_size
        if aligned <= req.kv.num_locked:
            return
        ids = req.tokens(0, n)
        done = self.cache.insert(ids, req.kv.slots[:n], req.namespace, req.hints.priority)
        if self.trace is not None:
            self.trace.append(("insert", req.namespace, tuple(ids[:aligned])))
        self.free(req.kv.slots[req.kv.num_locked : done.prefix_len])  # duplicates of the tree's
        held = done.position.prefix_len
        if held <= req.kv.num_locked:
            return  # the cache took nothing (disabled): the slots stay the request's
        self.cache.lock(done.position)
        if req.kv.lock_pos is not None:
            self.cache.unlock(req.kv.lock_pos)
        req.kv.slots[:held] = done.indices
        req.kv.lock_pos = done.position
        kv, key = req.kv, ids[:held]
        if self.tiers.write_policy == "write_through":
            self.tiers.store(req.namespace, key, kv.num_locked, kv.slots[:held], kv.chunk_names)
        kv.num_locked = held

    def keep_locked_prefix(self, req: Req) -> None:
        """A pin: insert what it computed, keep only the locked whole pages."""
        self.cache_prefix(req)
        self.free(req.kv.slots[req.kv.num_locked :])  # a partial last page cannot be shared
        req.kv.slots = req.kv.slots[: req.kv.num_locked].clone()

    def release(self, req: Req, insert: bool) -> None:
        """Give up the request's KV: into the tree (insert) or back to the allocator."""
        if insert:
            self.cache_prefix(req)
        if req.kv.lock_pos is not None:
            self.cache.unlock(req.kv.lock_pos)
        self.free(req.kv.slots[req.kv.num_locked :])
        req.kv.reset()

    def mark_queued_reads(self) -> None:
        """Refresh the waiting requests' queued-read marks (graph eviction's future)."""
        self.marks.mark_queued_reads(self.queued_reads.positions)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def flush(self) -> int:
        """Evict every unlocked cached token; return how many."""
        return self.cache.evict(self.cache.evictable_size)

    def persist(self) -> int:
        """Before a clean shutdown: every cached path and every host chunk to disk, so a
        restart on the same directory starts warm. Returns how many chunks were written."""
        return self.tiers.persist(self.cache.path_of(leaf) for leaf in self.cache.leaves())

    # ------------------------------------------------------------------ checks
    def check_integrity(self, holders: Sequence[Req]) -> None:
        """Assert each holder's locked prefix is the tree's, and slot conservation."""
        for req in holders:
            if req.status is ReqStatus.PINNED:  # keeps its locked whole pages, nothing more
                assert req.kv.num_locked == req.kv.capacity <= req.kv.num_computed, req
            else:
                assert req.kv.num_locked <= req.kv.num_computed <= req.kv.capacity, req
            assert req.kv.num_locked % self.page_size == 0, req
            if req.kv.num_locked:
                match = self.cache.match_prefix(req.all_ids[: req.kv.num_locked], req.namespace)
                assert match.prefix_len == req.kv.num_locked, f"{req}: locked prefix left the tree"
                assert torch.equal(match.indices, req.kv.slots[: req.kv.num_locked]), req
        owned = sum(r.kv.capacity - r.kv.num_locked for r in holders)
        self.cache.check_integrity(num_caller_slots=owned)
        self.tiers.check_integrity()
