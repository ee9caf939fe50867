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

import itertools
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.base import NullCache, PrefixCache
from runtime.cache.graph_marks import CONTINUATION_GRACE_S, GraphMarks, NoMarks
from runtime.cache.oracle import OracleMarks
from runtime.cache.radix import RadixCache, TreePosition, owner_of
from runtime.cache.tiers import KVTiers
from runtime.config import EngineConfig
from runtime.protocol import MAX_HINT_RETURN_S
from runtime.scheduler.request import Req, ReqStatus

PREFETCH_QUEUE_DEPTH = 16  # waiting requests, in admission order, whose disk chunks are prefetched
HOT_READS = 2  # write_through_selective: a prefix is copied down at its second cache hit
# admission waits at most this long for a request's chunk files to be read (prefetch thread);
# then it starts and computes what is not read (a slow or hostile disk holds nobody longer)
DISK_WAIT_S = 2.0
PREFETCH_LEAD_S = 2.0  # a branch that declared its return is prefetched this long before it
# branches remembered per owner (paused right away; declared returns): the oldest goes first, so
# a client naming a new program per request keeps at most this many (and their token ids)
MAX_BRANCHES_PER_OWNER = 256
MAX_BRANCHES = 4096  # ... and in all (without API keys owners are names clients choose)


class KVManager:
    """Owns the slot allocator, the prefix cache and its eviction marks; moves requests' KV
    between them following the protocol above."""

    def __init__(
        self,
        config: EngineConfig,
        num_slots: int,
        queued_positions: Callable[[], Iterable[TreePosition]],
        tiers: KVTiers | None = None,
    ) -> None:
        self.page_size = config.page_size
        self.allocator = SlotAllocator(num_slots, self.page_size)
        self.cache: PrefixCache
        if config.disable_radix_cache:
            self.cache = NullCache(self.allocator)
            self.marks: NoMarks = NoMarks()
        else:
            self.cache = RadixCache(self.allocator, self.page_size, config.eviction_policy)
            marks = {"graph": GraphMarks, "oracle": OracleMarks}.get(config.eviction_policy)
            self.marks = marks(self.cache) if marks else NoMarks()
        # admission holds back requests that would evict KV a known reader needs soon
        self.keeps_wanted = isinstance(self.marks, GraphMarks)
        self._queued_positions = queued_positions  # waiting requests' matches, admission order
        # seconds; times when paused branches are expected back (benchmarks set a simulated one)
        self.clock: Callable[[], float] = time.monotonic
        self.now_s = 0.0  # read once a step: branches pausing in one step tie, deterministically
        self.trace: list[tuple] | None = [] if config.record_trace else None
        # paused branches back right away: (owner, program, branch) -> (pause s, tokens still
        # to come), at most MAX_BRANCHES_PER_OWNER per owner
        self._in_flight = _BranchTable()
        self.tiers = tiers if isinstance(self.cache, RadixCache) else None
        if self.tiers is not None:
            self.cache.demote_sink = self.tiers.demote
        # branches that declared when they return: (owner, program, branch) -> (return s, namespace,
        # ids, their chunk names), prefetched from disk PREFETCH_LEAD_S ahead; at most
        # MAX_BRANCHES_PER_OWNER per owner
        self._returning = _BranchTable()
        self._disk_waits: dict[str, float] = {}  # rid -> when admission began to wait for files

    # ------------------------------------------------------------------ sizes
    def available_slots(self, reserved: int) -> int:
        """Slots admission may promise: free + evictable - what running requests still need."""
        return self.allocator.num_free_slots + self.cache.evictable_size - reserved

    @property
    def capacity_for_one(self) -> int:
        """The most one request could ever hold now: everything not protected."""
        return self.allocator.num_slots - self.cache.protected_size

    def shares_inflight(self, req: Req, cached: int, running: Sequence[Req]) -> bool:
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

    def read_clock(self) -> None:
        """Once a step, before anything is released: the time paused branches are timed by."""
        self.now_s = self.clock()
        self.marks.advance(self.now_s)
        if self.tiers is not None:
            self.tiers.flush_events()

    def arrived(self, req: Req) -> None:
        """A request reached the queue: its branch's next turn is no longer to come."""
        if self._in_flight or self._returning:
            key = _branch_key(req)  # the owner's own branch: another tenant's is never touched
            self._in_flight.pop(key)
            self._returning.pop(key)

    def in_flight_tokens(self, running: Sequence[Req]) -> Counter:
        """Per owner, about how many tokens the work in flight will still add
        (GraphHints.future_tokens, each at most the pool): branches paused to come back right
        away (within the grace) and running requests."""
        expired = [
            key
            for key, (pause_s, _) in self._in_flight.items()
            if pause_s < self.now_s - CONTINUATION_GRACE_S
        ]
        for key in expired:
            self._in_flight.pop(key)
        tokens: Counter = Counter()
        for (owner, _, _), (_, paused) in self._in_flight.items():
            tokens[owner] += paused
        for req in running:
            tokens[owner_of(req.namespace)] += future_tokens(req, self.allocator.num_slots)
        return tokens

    def mark_queued_reads(self) -> None:
        """Refresh the waiting requests' queued-read marks (graph eviction's future)."""
        self.marks.mark_queued_reads(self._queued_positions)

    @property
    def prefetches(self) -> bool:
        """Whether there is host memory (L2, or the staging area of chunk files) to hold
        what is read next."""
        return self.tiers is not None and self.tiers.hold_budget_chunks > 0

    def prefetch(self, waiting: Iterable[tuple[Req, TreePosition]]) -> None:
        """Once a step: keep in host memory what the graph says is read next (the first
        waiting requests in admission order, with their current matches; branches whose
        declared return is near), loading it from disk if need be, so admission copies from
        host memory. Never waits."""
        tiers = self.tiers
        budget = tiers.hold_budget_chunks  # the soonest readers first; held chunks never lapse
        for req, position in itertools.islice(waiting, PREFETCH_QUEUE_DEPTH):
            if budget <= 0:
                return
            ids, start, limit = req.all_ids, position.prefix_len, req.match_limit
            extent = tiers.extent(req.namespace, ids, start, limit, req.chunk_names)
            budget -= tiers.prefetch(extent, budget)
        for key, (return_s, namespace, ids, names) in list(self._returning.items()):
            if return_s + CONTINUATION_GRACE_S < self.now_s:
                self._returning.pop(key)  # it never came back
            elif return_s - PREFETCH_LEAD_S <= self.now_s and budget > 0:
                start = self.cache.match_prefix(ids, namespace).prefix_len
                budget -= tiers.prefetch(
                    tiers.extent(namespace, ids, start, len(ids), names), budget
                )

    def lower_ready(self, req: Req, position: TreePosition) -> bool:
        """Admission's question to the lower tiers: are the chunk files that continue this
        match read (on the prefetch thread: the loop thread never reads a file), or has it
        waited DISK_WAIT_S for them (then what is not read is computed)?"""
        if self.tiers is None:
            return True
        ids = req.all_ids
        extent = self.tiers.extent(
            req.namespace, ids, position.prefix_len, req.match_limit, req.chunk_names
        )
        if self.tiers.ready(extent):
            self._disk_waits.pop(req.rid, None)
            return True
        now_s = time.monotonic()  # file reads take real time, whatever `clock` simulates
        return now_s - self._disk_waits.setdefault(req.rid, now_s) > DISK_WAIT_S

    # ------------------------------------------------------------------ protocol
    def take_prefix(self, req: Req, position: TreePosition) -> int:
        """Admission: lock the matched prefix up to `position` and adopt its slots, then
        load what the lower tiers hold past it. Returns the device hit (tokens)."""
        cached = position.prefix_len
        if cached:
            self.cache.lock(position)
            self.marks.mark_read(position)
            req.lock_pos = position
            req.slots = self.cache.slot_indices(position).clone()
        req.num_computed = req.num_locked = cached
        if self.tiers is not None:
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
        if self.cache.note_read(position) == HOT_READS:
            ids = req.tokens(0, req.num_locked)
            self.tiers.store(req.namespace, ids, 0, req.slots, req.chunk_names)

    def _load_below(self, req: Req) -> None:
        """Continue a request's device match from the lower tiers: fresh slots, a copy, an
        insert (so the loaded tokens are locked and shared like cached ones)."""
        ids = req.all_ids
        extent = self.tiers.extent(
            req.namespace, ids, req.num_locked, req.match_limit, req.chunk_names
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
        req.slots = torch.cat([req.slots, slots[:loaded]])
        req.num_computed = req.num_locked + loaded
        req.num_loaded += loaded
        self.cache_prefix(req)

    def grow(self, req: Req, upto: int, evict: bool = True) -> bool:
        """Make req.slots cover `upto` tokens (whole pages), evicting if needed and allowed
        (a speculative draft takes free slots only)."""
        short = upto - req.capacity
        if short <= 0:
            return True
        num_tokens = -(-short // self.page_size) * self.page_size
        room = self.make_room(num_tokens) if evict else num_tokens <= self.allocator.num_free_slots
        if not room:
            return False
        req.slots = torch.cat([req.slots, self.allocator.alloc(num_tokens)])
        return True

    def trim(self, req: Req) -> None:
        """After a verified draft: keep the pages up to the next token's slot, free the rest
        (the rejected guesses')."""
        keep = -(-(req.num_computed + 1) // self.page_size) * self.page_size
        if req.capacity > keep:
            self.free(req.slots[keep:])
            req.slots = req.slots[:keep]

    def make_room(self, num_tokens: int) -> bool:
        """Evict until `num_tokens` slots are free; False if the unlocked tree is too small."""
        missing = num_tokens - self.allocator.num_free_slots
        if missing > 0:
            self.marks.mark_queued_reads(self._queued_positions)
            self.cache.evict(missing)
        return self.allocator.num_free_slots >= num_tokens

    def cache_prefix(self, req: Req) -> None:
        """Insert the computed whole pages into the tree and move the request's lock down."""
        n = req.num_computed
        aligned = n // self.page_size * self.page_size
        if aligned <= req.num_locked:
            return
        ids = req.tokens(0, n)
        done = self.cache.insert(ids, req.slots[:n], req.namespace, req.hints.priority)
        if self.trace is not None:
            self.trace.append(("insert", req.namespace, tuple(ids[:aligned])))
        self.free(req.slots[req.num_locked : done.prefix_len])  # duplicates of the tree's
        held = done.position.prefix_len
        if held <= req.num_locked:
            return  # the cache took nothing (disabled): the slots stay the request's
        self.cache.lock(done.position)
        if req.lock_pos is not None:
            self.cache.unlock(req.lock_pos)
        req.slots[:held] = done.indices
        req.lock_pos = done.position
        if self.tiers is not None and self.tiers.write_policy == "write_through":
            self.tiers.store(
                req.namespace, ids[:held], req.num_locked, req.slots[:held], req.chunk_names
            )
        req.num_locked = held

    def keep_locked_prefix(self, req: Req) -> None:
        """A pin: insert what it computed, keep only the locked whole pages."""
        self.cache_prefix(req)
        self.free(req.slots[req.num_locked :])  # a partial last page cannot be shared
        req.slots = req.slots[: req.num_locked].clone()

    def release(self, req: Req, insert: bool) -> None:
        """Give up the request's KV: into the tree (insert) or back to the allocator."""
        if insert:
            self.cache_prefix(req)
            if req.hints.continuation and req.lock_pos is not None:
                self._paused(req)
        if req.lock_pos is not None:
            self.cache.unlock(req.lock_pos)
        self.free(req.slots[req.num_locked :])
        req.reset_kv()
        self._disk_waits.pop(req.rid, None)

    def _paused(self, req: Req) -> None:
        """A continuing branch finished a request: mark its path, and remember it (bounded
        per owner) as work in flight or as a declared return to prefetch for."""
        hints = req.hints
        # a return declared further out than the horizon is "not soon", however far
        after_s = min(hints.next_turn_after_s or 0.0, MAX_HINT_RETURN_S)
        self.marks.mark_continuation(req.lock_pos, self.now_s + after_s, not after_s)
        if hints.program_id is None:
            return
        key = _branch_key(req)
        if not after_s and self.keeps_wanted:
            tokens = future_tokens(req, self.allocator.num_slots)
            self._in_flight.put(key, (self.now_s, tokens))
        if after_s and self.tiers is not None:
            ids = array("i", req.tokens(0, req.num_locked))  # 4 bytes a token, not 36
            self._returning.put(key, (self.now_s + after_s, req.namespace, ids, []))

    @property
    def num_remembered_branches(self) -> tuple[int, int]:
        """(paused right away, declared returns) remembered now (tests, metrics)."""
        return len(self._in_flight), len(self._returning)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.allocator.free(slots)

    def flush(self) -> int:
        """Evict every unlocked cached token; return how many."""
        return self.cache.evict(self.cache.evictable_size)

    def persist(self) -> int:
        """Before a clean shutdown: every cached path and every host chunk to disk, so a
        restart on the same directory starts warm. Returns how many chunks were written."""
        if self.tiers is None:
            return 0
        return self.tiers.persist(self.cache.path_of(leaf) for leaf in self.cache.leaves())

    # ------------------------------------------------------------------ checks
    def check_integrity(self, holders: Sequence[Req]) -> None:
        """Assert each holder's locked prefix is the tree's, and slot conservation."""
        for req in holders:
            if req.status is ReqStatus.PINNED:  # keeps its locked whole pages, nothing more
                assert req.num_locked == req.capacity <= req.num_computed, req
            else:
                assert req.num_locked <= req.num_computed <= req.capacity, req
            assert req.num_locked % self.page_size == 0, req
            if req.num_locked:
                match = self.cache.match_prefix(req.all_ids[: req.num_locked], req.namespace)
                assert match.prefix_len == req.num_locked, f"{req}: locked prefix left the tree"
                assert torch.equal(match.indices, req.slots[: req.num_locked]), req
        owned = sum(r.capacity - r.num_locked for r in holders)
        self.cache.check_integrity(num_caller_slots=owned)
        if self.tiers is not None:
            self.tiers.check_integrity()


def future_tokens(req: Req, pool_slots: int) -> int:
    """What a request's program will still add to its sequence after it, if it is back right
    away (0 otherwise: a declared return is not work in flight); a hint of more than the
    pool holds counts as the pool."""
    hints = req.hints
    right_away = hints.continuation and not hints.next_turn_after_s
    return min(hints.future_tokens or 0, pool_slots) if right_away else 0


def _branch_key(req: Req) -> tuple:
    """A program branch, qualified by its owner, first (program ids are the client's to
    choose)."""
    return owner_of(req.namespace), req.hints.program_id, req.hints.branch_id


class _BranchTable:
    """A branch key (_branch_key: its owner first) -> an entry, at most
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

    def items(self) -> list[tuple[tuple, tuple]]:
        return list(self._entries.items())

    def values(self) -> list[tuple]:
        return list(self._entries.values())
