"""Routing without a model: replicas are real radix trees (with their KV events), requests are
recorded token traces, time is a cost model. Computed-token counts are what an engine would
compute (match at admission, insert prompt and reply at the end); times are model units.

A trace is a list of programs; a program is a list of stages; a stage is a list of requests that
may run at once (a fork's branches), each `(namespace, prompt_ids, output_ids)`. A program's
next stage is submitted when its current one has finished (a conversation's next turn).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.events import KVEventPublisher
from runtime.cache.radix import RadixCache
from runtime.cluster.policy import RouterConfig
from runtime.cluster.router import Router

Request = tuple[Hashable, tuple[int, ...], tuple[int, ...]]
Program = list[list[Request]]

PREFILL_COST_PER_TOKEN = 1.0  # model time units
DECODE_COST_PER_TOKEN = 4.0  # one decode step costs about a few prefill tokens at batch 1


class SimReplica:
    """A radix tree and its slot pool standing in for an engine; counts computed tokens."""

    def __init__(self, max_kv_tokens: int, page_size: int = 1) -> None:
        self.publisher = KVEventPublisher()
        allocator = SlotAllocator(max_kv_tokens, page_size)
        self.cache = RadixCache(allocator, page_size, listeners=(self.publisher,))
        self.subscription = self.publisher.subscribe((), max_pending_events=1_000_000)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0

    def admit(self, namespace: Hashable, prompt_ids: tuple[int, ...]) -> int:
        """Match the prompt as the scheduler would; returns tokens to compute."""
        matched = self.cache.match_prefix(prompt_ids, namespace).prefix_len
        self.num_cached_tokens += matched
        self.num_computed_tokens += len(prompt_ids) - matched
        return len(prompt_ids) - matched

    def finish(self, namespace: Hashable, ids: tuple[int, ...]) -> None:
        """Insert prompt + reply (whole pages), evicting unlocked leaves to make room."""
        cache, ps = self.cache, self.cache.page_size
        aligned = ids[: len(ids) // ps * ps]
        match = cache.match_prefix(aligned, namespace)
        need = len(aligned) - match.prefix_len
        if need == 0:
            return
        cache.lock(match.position)  # what we extend must survive the eviction
        if cache.allocator.num_free_slots < need:
            cache.evict(need - cache.allocator.num_free_slots)
        cache.unlock(match.position)
        new = cache.allocator.alloc(need) if cache.allocator.can_alloc(need) else None
        if new is None:
            return  # a prompt larger than the free pool: computed, not kept
        cache.insert(aligned, torch.cat([match.indices, new]), namespace)


@dataclass
class SimResult:
    """What a simulated run computed, and how the work spread."""

    num_requests: int
    num_prompt_tokens: int
    num_computed_tokens: int
    per_replica_computed: list[int]
    per_replica_busy: list[float]
    makespan: float

    @property
    def hit_rate(self) -> float:
        """Cached / prompt tokens."""
        return 1.0 - self.num_computed_tokens / max(self.num_prompt_tokens, 1)

    @property
    def load_imbalance(self) -> float:
        """Busiest replica's busy time over the mean (1.0 is even)."""
        mean = sum(self.per_replica_busy) / len(self.per_replica_busy)
        return max(self.per_replica_busy) / mean if mean else 1.0


@dataclass(order=True)
class _Job:
    done_at: float
    seq: int
    replica: int = field(compare=False)
    rid: str = field(compare=False)
    program: int = field(compare=False)
    request: Request = field(compare=False)


def simulate(
    programs: Sequence[Program],
    num_replicas: int,
    config: RouterConfig,
    max_kv_tokens: int,
    concurrency: int,
    placement: Sequence[int] | None = None,
) -> SimResult:
    """Run `concurrency` programs at a time through a router over SimReplicas. With
    `placement`, program i's requests go to replica placement[i] (graph-aware placement)."""
    replicas = [SimReplica(max_kv_tokens) for _ in range(num_replicas)]
    router = Router(config)
    for index in range(num_replicas):
        router.add_replica(index, capacity_tokens=max_kv_tokens)
    state = _SimState(programs, replicas, router, placement)
    for _ in range(min(concurrency, len(programs))):
        state.start_next_program(0.0)
    while state.events:
        job = heapq.heappop(state.events)
        state.complete(job)
    prompts = sum(len(r[1]) for p in programs for stage in p for r in stage)
    return SimResult(
        sum(len(stage) for p in programs for stage in p),
        prompts,
        sum(r.num_computed_tokens for r in replicas),
        [r.num_computed_tokens for r in replicas],
        state.busy,
        state.now,
    )


class _SimState:
    """Queues per replica (one request served at a time), pending stages, the clock."""

    def __init__(self, programs, replicas, router, placement) -> None:
        self.programs, self.replicas, self.router = programs, replicas, router
        self.placement = placement
        self.queues: list[deque[_Job]] = [deque() for _ in replicas]
        self.serving: list[_Job | None] = [None] * len(replicas)
        self.busy = [0.0] * len(replicas)
        self.events: list[_Job] = []
        self.stage_of = [0] * len(programs)
        self.left_in_stage = [0] * len(programs)
        self.next_program = 0
        self.now = 0.0
        self.seq = 0

    def start_next_program(self, now: float) -> None:
        """Begin the next program waiting (a client freed up)."""
        if self.next_program < len(self.programs):
            self.next_program += 1
            self.submit_stage(self.next_program - 1, now)

    def submit_stage(self, program: int, now: float) -> None:
        """Route every request of a program's current stage and queue it there."""
        stage = self.programs[program][self.stage_of[program]]
        self.left_in_stage[program] = len(stage)
        prefer = self.placement[program] if self.placement is not None else None
        for request in stage:
            self.seq += 1
            rid = f"p{program}-{self.seq}"
            replica = self.router.route(rid, request[1], request[0], prefer=prefer)
            self.queues[replica].append(_Job(0.0, self.seq, replica, rid, program, request))
            self.serve_next(replica, now)

    def serve_next(self, replica: int, now: float) -> None:
        """Start a replica's next queued request if it is idle: match now, finish later."""
        if self.serving[replica] is not None or not self.queues[replica]:
            return
        job = self.queues[replica].popleft()
        namespace, prompt, output = job.request
        computed = self.replicas[replica].admit(namespace, prompt)
        cost = computed * PREFILL_COST_PER_TOKEN + len(output) * DECODE_COST_PER_TOKEN
        job.done_at = now + cost
        self.busy[replica] += cost
        self.serving[replica] = job
        heapq.heappush(self.events, job)

    def complete(self, job: _Job) -> None:
        """A request ends: insert it, feed its events to the router, advance its program."""
        self.now = job.done_at
        namespace, prompt, output = job.request
        sim = self.replicas[job.replica]
        sim.finish(namespace, prompt + output[:-1])  # the last sampled token is never fed
        self.router.apply_events(job.replica, sim.subscription.poll())
        self.router.finish(job.rid)
        self.serving[job.replica] = None
        self.serve_next(job.replica, self.now)
        self.left_in_stage[job.program] -= 1
        if self.left_in_stage[job.program] == 0:
            self.stage_of[job.program] += 1
            if self.stage_of[job.program] < len(self.programs[job.program]):
                self.submit_stage(job.program, self.now)
            else:
                self.start_next_program(self.now)
