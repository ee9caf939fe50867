"""RadixCache on hand-built trees: the chapter examples, splits, locks, pages, namespaces."""

from __future__ import annotations

import pytest
import torch

from runtime.cache.allocator import SlotAllocator
from runtime.cache.eviction import EVICTION_POLICIES
from runtime.cache.radix import RadixCache, RadixCacheError, StalePositionError


def make_cache(num_slots=4096, page_size=1, policy="lru") -> RadixCache:
    return RadixCache(SlotAllocator(num_slots, page_size), page_size, policy)


def cache_sequence(cache: RadixCache, token_ids, namespace=None, priority=0) -> int:
    """What a request does when it finishes: slots for every token, insert, free duplicates."""
    slots = cache.allocator.alloc(len(token_ids))
    prefix_len = cache.insert(token_ids, slots, namespace=namespace, priority=priority).prefix_len
    cache.allocator.free(slots[:prefix_len])
    return prefix_len


def test_chapter_standalone_example():
    cache = make_cache()
    prefix_lens = [
        cache_sequence(cache, seq)
        for seq in ([1, 2, 3], [1, 2, 3], [1, 2, 4, 5], [1, 2, 4, 5, 6, 7], [8, 9, 10, 11, 12])
    ]
    assert prefix_lens == [0, 3, 2, 4, 0]
    text = cache.pretty_print()
    # inserting [1, 2, 4, 5] split [1, 2, 3] into [1, 2] -> [3]
    assert text.splitlines()[1:6] == [
        "  len=2 [1, 2] r=0",
        "    len=1 [3] r=0",
        "    len=2 [4, 5] r=0",
        "      len=2 [6, 7] r=0",
        "  len=5 [8, 9, 10, 11, 12] r=0",
    ]
    match = cache.match_prefix([1, 2, 3, 13, 14])
    assert match.prefix_len == 3
    assert match.indices.tolist() == cache.match_prefix([1, 2, 3]).indices.tolist()
    assert cache.total_size == 12 and cache.num_nodes == 5
    cache.check_integrity(num_caller_slots=0)


def test_chapter_three_requests_share_4343_of_6910_tokens():
    system, fewshot = list(range(512)), list(range(1000, 2543))
    query1, query2 = list(range(5000, 5096)), list(range(6000, 6080))
    rag = list(range(8000, 10112))
    requests = [system + fewshot + query1, system + fewshot + query2, system + rag]
    cache = make_cache(num_slots=8192)
    for seq in requests:
        cache_sequence(cache, seq)
    assert sum(map(len, requests)) == 6910
    assert cache.total_size == 4343
    # R2 reuses S + F (2,055 tokens); locking its match protects exactly those
    match = cache.match_prefix(system + fewshot + list(range(7000, 7080)))
    assert match.prefix_len == 2055
    assert cache.lock(match.position) == -2055
    assert cache.protected_size == 2055
    cache.check_integrity(num_caller_slots=0)


def test_match_is_pure_and_lock_splits_exactly_there():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3, 4, 5])
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.prefix_len == 3 and cache.num_nodes == 1, "a read must not split"
    delta = cache.lock(match.position)
    assert delta == -3 and cache.num_nodes == 2
    assert cache.protected_size == 3 and cache.evictable_size == 2
    assert cache.evict(100) == 2, "the unlocked tail [4, 5] goes, the locked [1, 2, 3] stays"
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 3
    cache.unlock(match.position)
    assert cache.evict(100) == 3
    cache.check_integrity(num_caller_slots=0)


def test_positions_survive_later_splits_and_go_stale_on_eviction():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3, 4, 5, 6])
    match = cache.match_prefix([1, 2, 3, 4, 5, 9])  # ends inside the single edge
    cache_sequence(cache, [1, 2, 7])  # splits that edge above the position
    cache_sequence(cache, [1, 2, 3, 4, 8])  # and again, just below it
    cache.lock(match.position)
    assert cache.protected_size == 5
    cache.check_integrity(num_caller_slots=0)
    cache.unlock(match.position)
    stale = cache.match_prefix([1, 2, 7]).position
    cache.evict(cache.total_size)
    with pytest.raises(StalePositionError):
        cache.lock(stale)
    cache.check_integrity(num_caller_slots=0)


def test_unlock_errors_leave_the_tree_unchanged():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3])
    match = cache.match_prefix([1, 2, 3])
    with pytest.raises(RadixCacheError, match="not locked"):
        cache.unlock(match.position)
    inside = cache.match_prefix([1, 2]).position
    with pytest.raises(RadixCacheError, match="no lock ends"):
        cache.unlock(inside)
    cache.check_integrity(num_caller_slots=0)


def test_eviction_is_leaf_first_and_cascades_up_a_dead_branch():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3])
    cache_sequence(cache, [1, 2, 4])
    cache_sequence(cache, [1, 2, 4, 5, 6])
    held = cache.match_prefix([1, 2, 3])
    cache.lock(held.position)
    # candidates: [5, 6] only ([4] has a child, [3] and [1, 2] are locked)
    assert cache.num_candidates == 1
    assert cache.evict(3) == 3, "[5, 6] then its parent [4], which became a leaf, in one call"
    assert cache.match_prefix([1, 2, 4]).prefix_len == 2
    assert cache.evict(10) == 0, "only locked tokens remain"
    cache.check_integrity(num_caller_slots=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_eviction_takes_only_the_tail_it_needs_and_the_head_stays_cached(page_size):
    cache = make_cache(page_size=page_size)
    long = list(range(1, 8 * page_size + 1))  # one leaf of 8 pages
    cache_sequence(cache, long)
    cache_sequence(cache, [99] * page_size)
    last = cache.match_prefix([99] * page_size).position
    cache.lock(last)
    cache.unlock(last)  # the long leaf is now least recently used
    free_before = cache.allocator.num_free_slots
    assert cache.evict(page_size + 1) == 2 * page_size, "two pages, not the whole leaf"
    assert cache.allocator.num_free_slots == free_before + 2 * page_size
    assert cache.match_prefix(long).prefix_len == 6 * page_size, "the head is still cached"
    assert cache.match_prefix([99] * page_size).prefix_len == page_size, "the other leaf stays"
    cache.check_integrity(num_caller_slots=0)
    assert cache.evict(1) == page_size, "the same leaf's tail goes next"
    assert cache.match_prefix(long).prefix_len == 5 * page_size
    assert cache.evict(cache.total_size) == 6 * page_size
    assert cache.total_size == 0
    cache.check_integrity(num_caller_slots=0)


def test_insert_reusing_the_trees_own_slots_dedups():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3])
    match = cache.match_prefix([1, 2, 3, 4, 5])
    cache.lock(match.position)
    new = cache.allocator.alloc(2)
    slots = torch.cat([match.indices, new])
    # nothing to free: [:3] are the tree's own
    assert cache.insert([1, 2, 3, 4, 5], slots).prefix_len == 3
    cache.unlock(match.position)
    assert cache.match_prefix([1, 2, 3, 4, 5]).indices.tolist() == slots.tolist()
    with pytest.raises(ValueError, match="already holds"):
        cache.insert([7, 8], new)
    cache.check_integrity(num_caller_slots=0)


def test_insert_rejects_free_slots_and_size_mismatch():
    cache = make_cache()
    with pytest.raises(ValueError, match="free or outside"):
        cache.insert([1, 2], torch.tensor([0, 1]))
    slots = cache.allocator.alloc(3)
    with pytest.raises(ValueError, match="3 slot indices"):
        cache.insert([1, 2], slots)
    cache.allocator.free(slots)
    cache.check_integrity(num_caller_slots=0)


def test_pages_match_whole_pages_and_key_children_by_first_page():
    cache = make_cache(num_slots=256, page_size=4)
    seq = list(range(10))  # 2 whole pages + 2 tokens
    slots = cache.allocator.alloc(12)[:10]
    assert cache.insert(seq, slots).prefix_len == 0
    assert cache.total_size == 8, "the unaligned tail stays with the caller"
    assert cache.match_prefix(seq).prefix_len == 8
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 99, 7]).prefix_len == 4, "rounds down"
    assert cache.match_prefix([0, 1, 2]).prefix_len == 0
    other = list(range(4)) + [50, 51, 52, 53]
    other_slots = cache.allocator.alloc(8)
    assert cache.insert(other, other_slots).prefix_len == 4
    cache.allocator.free(other_slots[:4])
    text = cache.pretty_print()
    assert "len=4 [0, 1, 2, 3] r=0" in text and "len=4 [50, 51, 52, 53] r=0" in text
    # of the 12 slots allocated for `seq`, the tree holds 8; the last page is still the caller's
    cache.check_integrity(num_caller_slots=4)


def test_namespaces_never_share_or_match_across():
    cache = make_cache()
    cache_sequence(cache, [1, 2, 3], namespace="tenant-a")
    assert cache.match_prefix([1, 2, 3]).prefix_len == 0
    assert cache.match_prefix([1, 2, 3], namespace="tenant-b").prefix_len == 0
    assert cache_sequence(cache, [1, 2, 3], namespace="tenant-b") == 0
    assert cache.total_size == 6
    a = cache.match_prefix([1, 2, 3], namespace="tenant-a").indices
    b = cache.match_prefix([1, 2, 3], namespace="tenant-b").indices
    assert not set(a.tolist()) & set(b.tolist())
    cache.check_integrity(num_caller_slots=0)


def test_reset_returns_every_slot_and_refuses_while_locked():
    cache = make_cache(num_slots=64)
    cache_sequence(cache, [1, 2, 3])
    match = cache.match_prefix([1, 2])
    cache.lock(match.position)
    with pytest.raises(RadixCacheError, match="locked"):
        cache.reset()
    cache.unlock(match.position)
    cache.reset()
    assert cache.total_size == 0 and cache.allocator.num_free_slots == 64
    cache.check_integrity(num_caller_slots=0)


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown eviction policy 'lrv'"):
        make_cache(policy="lrv")


# A = [1, 1], B = [2, 2], C = [3, 3] inserted in that order with priorities 5, 3, 1;
# C is then used twice and A once, so: last access B < C < A, hits B=1 < A=2 < C=3.
EXPECTED_ORDER = {
    "lru": "BCA",
    "mru": "ACB",
    "fifo": "ABC",
    "filo": "CBA",
    "lfu": "BAC",
    "slru": "BCA",  # B is probationary (1 hit); C and A are protected, LRU among them
    "priority": "CBA",
    "graph": "BCA",  # no known future uses: plain LRU
    "oracle": "BCA",  # no recording loaded: every next use is "never", LRU among them
}


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_eviction_order_per_policy(policy):
    cache = make_cache(policy=policy)
    leaves = {"A": [1, 1], "B": [2, 2], "C": [3, 3]}
    for name, prio in zip("ABC", (5, 3, 1), strict=True):
        cache_sequence(cache, leaves[name], priority=prio)
    for name in "CCA":
        pos = cache.match_prefix(leaves[name]).position
        cache.lock(pos)
        cache.unlock(pos)
    order = ""
    while cache.total_size:
        before = {n for n, seq in leaves.items() if cache.match_prefix(seq).prefix_len}
        assert cache.evict(2) == 2
        after = {n for n, seq in leaves.items() if cache.match_prefix(seq).prefix_len}
        (gone,) = before - after
        order += gone
        cache.check_integrity(num_caller_slots=0)
    assert order == EXPECTED_ORDER[policy]


def test_graph_policy_orders_by_known_next_use():
    """No reader first (LRU), then branches that declared when they return (latest first),
    then branches back right away, then queued reads, the farthest queue position first."""
    cache = make_cache(policy="graph")
    leaves = {name: [i, i] for i, name in enumerate("ABCDEF", start=1)}
    for seq in leaves.values():
        cache_sequence(cache, seq)

    def node(name):
        return cache.resolve(cache.match_prefix(leaves[name]).position)

    futures = {"A": (3, -1), "B": (1, -5), "C": None, "D": (2, -7), "E": (1, -9), "F": None}
    for name, future in futures.items():
        if cache.policy.set_future(node(name), future):
            cache.reprioritize(node(name))
    assert cache.wanted_size == 4  # A (a queued read) and D (a branch back right away)
    order = ""
    while cache.total_size:
        before = {n for n, seq in leaves.items() if cache.match_prefix(seq).prefix_len}
        cache.evict(1)
        order += "".join(
            before - {n for n, seq in leaves.items() if cache.match_prefix(seq).prefix_len}
        )
        cache.check_integrity(num_caller_slots=0)
    assert order == "CFEBDA"
