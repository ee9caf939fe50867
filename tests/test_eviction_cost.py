"""The graph policy's cost per eviction does not grow with the cache: marks touch the waiting
requests' paths and the paused branch, the candidate heap re-ranks only what changed. Measured
as work (policy key evaluations, exact) and as time, at 1k and 100k leaves."""

from __future__ import annotations

import statistics
import time

import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.graph_policy import GraphMarks, GraphPolicy
from runtime.cache.radix import RadixCache

NUM_CALLS, NUM_QUEUED = 300, 8


class CountingGraphPolicy(GraphPolicy):
    def __init__(self) -> None:
        self.num_keys = 0

    def priority(self, node):
        self.num_keys += 1
        return super().priority(node)


def _leaf(cache: RadixCache, marks: GraphMarks, index: int) -> None:
    """A conversation leaf of 2 tokens whose branch paused at step `index`."""
    ids = (1 + index % 40_000, 50_000 + index)
    match = cache.match_prefix(ids)
    slots = torch.cat([match.indices, cache.allocator.alloc(len(ids) - match.prefix_len)])
    done = cache.insert(ids, slots)
    marks.mark_continuation(done.position, return_s=float(index))


def eviction_cost(num_leaves: int) -> tuple[float, float]:
    """(policy keys per eviction call, median seconds per call) with `num_leaves` cached leaves."""
    policy = CountingGraphPolicy()
    cache = RadixCache(SlotAllocator(2 * num_leaves + 64), 1, policy)
    marks = GraphMarks(cache)
    for index in range(num_leaves):
        _leaf(cache, marks, index)
    queued = [(1 + i % 40_000, 50_000 + i) for i in range(NUM_QUEUED)]  # the oldest are read

    def positions():
        return [cache.match_prefix(ids).position for ids in queued]

    policy.num_keys = 0
    seconds = []
    for call in range(NUM_CALLS):
        start = time.perf_counter()
        marks.mark_queued_reads(positions)
        cache.evict(2)  # the scheduler's make_room: marks, then evict
        seconds.append(time.perf_counter() - start)
        _leaf(cache, marks, num_leaves + call)  # the request that needed room (its pause)
    cache.check_integrity()
    return policy.num_keys / NUM_CALLS, statistics.median(seconds)  # robust to a busy machine


def test_graph_eviction_cost_is_flat_in_cache_size():
    small_keys, small_s = eviction_cost(1_000)
    large_keys, large_s = eviction_cost(100_000)
    assert large_keys == small_keys  # exactly the same re-ranking work per call
    assert large_s < 3 * small_s + 1e-4, (small_s, large_s)  # heap log factor only
