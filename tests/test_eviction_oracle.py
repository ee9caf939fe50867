"""The offline optimum (oracle.py) and the graph policy against it, on traces whose optimum is
known: equal-size disjoint prefixes are classic paging, where farthest-next-use (Belady) is
optimal and simple to compute independently; and where the graph knows the whole future (every
read queued, in order) its eviction order is the oracle's."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.allocator import SlotAllocator
from runtime.cache.graph_policy import GraphMarks
from runtime.cache.oracle import OracleMarks
from runtime.cache.radix import RadixCache
from runtime.cache.replay import replay

ITEM_LEN = 4  # tokens per page of the paging traces


def item_ids(item: int) -> tuple[int, ...]:
    return tuple(100 * item + k for k in range(ITEM_LEN))


def paging_trace(reads: list[int]) -> list[tuple]:
    """Read item i (a miss computes it: the insert follows), for each i in `reads`."""
    trace = []
    for item in reads:
        ids = item_ids(item)
        trace += [("access", None, ids, len(ids)), ("insert", None, ids)]
    return trace


def belady_misses(reads: list[int], capacity_items: int) -> int:
    """Classic demand paging under farthest-next-use: the minimum number of misses."""
    cached: set[int] = set()
    misses = 0
    for now, item in enumerate(reads):
        if item in cached:
            continue
        misses += 1
        if len(cached) == capacity_items:
            later = reads[now + 1 :]
            cached.remove(max(cached, key=lambda c: later.index(c) if c in later else math.inf))
        cached.add(item)
    return misses


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.integers(1, 5))
def test_oracle_replay_is_optimal_paging(reads, capacity_items):
    result = replay(paging_trace(reads), capacity_items * ITEM_LEN, "oracle")
    assert result.computed_tokens == belady_misses(reads, capacity_items) * ITEM_LEN
    lru = replay(paging_trace(reads), capacity_items * ITEM_LEN, "lru")
    assert result.computed_tokens <= lru.computed_tokens


def test_oracle_keeps_a_stable_subset_in_the_cyclic_case():
    """Four items read in a cycle with room for three: LRU misses every read; the optimum
    keeps a stable subset and misses about one read in three."""
    reads = [0, 1, 2, 3] * 6
    capacity = 3 * ITEM_LEN
    lru, oracle = (
        replay(paging_trace(reads), capacity, "lru"),
        replay(paging_trace(reads), capacity, "oracle"),
    )
    assert lru.hit_tokens == 0
    assert oracle.computed_tokens == belady_misses(reads, 3) * ITEM_LEN < len(reads) * ITEM_LEN


def _tree(policy: str, sequences: list[tuple[int, ...]], reads=None) -> RadixCache:
    """`sequences` inserted in order; for the oracle, `reads` is the recorded future."""
    total = sum(map(len, sequences))
    cache = RadixCache(SlotAllocator(total + 8), 1, policy)
    if reads is not None:  # loaded before the first insert, as engine_tools.load_eviction_oracle
        OracleMarks(cache).load([("access", None, ids, len(ids)) for ids in reads])
    for ids in sequences:
        match = cache.match_prefix(ids)
        new = cache.allocator.alloc(len(ids) - match.prefix_len)
        cache.insert(ids, torch.cat([match.indices, new]))
        cache.check_integrity()
    return cache


def _evict_order(cache: RadixCache, refresh_marks) -> list[tuple[int, tuple[int, ...]]]:
    """The order edges leave the tree, one victim per evict(1) call, integrity after each."""
    order = []
    while cache.num_candidates:
        candidates = cache._candidates.nodes()
        refresh_marks()
        cache.evict(1)
        cache.check_integrity()
        order += [(n.depth, n.key) for n in candidates if n.evicted]
    return order


sequence = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple)


@settings(max_examples=150, deadline=None)
@given(st.lists(sequence, min_size=1, max_size=10, unique=True), st.data())
def test_graph_with_every_read_queued_evicts_like_the_oracle(sequences, data):
    """Every future read is a waiting request, in admission order: the graph policy then
    knows what the oracle knows, and takes the same victims in the same order."""
    reads = data.draw(st.lists(st.sampled_from(sequences), max_size=12))
    graph, oracle = _tree("graph", sequences), _tree("oracle", sequences, reads)
    marks = GraphMarks(graph)

    def queued():
        return [graph.match_prefix(ids).position for ids in reads]

    graph_order = _evict_order(graph, lambda: marks.mark_queued_reads(queued))
    oracle_order = _evict_order(oracle, lambda: None)
    assert graph_order == oracle_order
    assert graph.total_size == oracle.total_size == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(sequence, min_size=1, max_size=10, unique=True), st.data())
def test_graph_told_when_paused_branches_return_evicts_like_the_oracle(sequences, data):
    """Every sequence is a paused branch that declared when it returns (next_turn_after_s):
    the graph policy then knows the order of the future reads, and takes the oracle's victims
    in the oracle's order."""
    returns = data.draw(st.permutations(range(len(sequences))))  # distinct return times
    reads = [ids for _, ids in sorted(zip(returns, sequences, strict=True))]
    graph, oracle = _tree("graph", sequences), _tree("oracle", sequences, reads)
    marks = GraphMarks(graph)
    for ids, return_s in zip(sequences, returns, strict=True):
        position = graph.match_prefix(ids).position
        graph.lock(position)  # as a running request's: its edge ends exactly there
        graph.unlock(position)
        marks.mark_continuation(position, float(return_s))
        graph.check_integrity()
    assert _evict_order(graph, lambda: None) == _evict_order(oracle, lambda: None)
    assert graph.total_size == oracle.total_size == 0
