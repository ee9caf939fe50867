"""Cache-aware ordering stays exact and cheap: only requests whose match moved re-match."""

from __future__ import annotations

from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache
from runtime.generation import GenerationState
from runtime.protocol import GraphHints, SamplingParams
from runtime.scheduler.policy import SchedulePolicy
from runtime.scheduler.request import Req, ReqKind

PARAMS = SamplingParams(max_new_tokens=4)


def make_req(i: int, ids: list[int]) -> Req:
    gen = GenerationState(PARAMS, ids, None, (), 64)
    return Req(f"r{i}", ids, gen, ReqKind.GENERATE, None, GraphHints(), arrival=i)


def insert(cache: RadixCache, ids: list[int]) -> None:
    slots = cache.allocator.alloc(len(ids))
    cache.allocator.free(slots[: cache.insert(ids, slots).prefix_len])


def test_lpm_over_10000_waiting_requests_rematches_only_what_changed():
    cache = RadixCache(SlotAllocator(1 << 16))
    groups = [[g] * 10 for g in range(100)]  # 100 prefixes of 10 tokens
    for g in range(50):
        insert(cache, groups[g])
    waiting = [make_req(i, groups[i % 100] + [1000 + i, 7]) for i in range(10_000)]
    policy = SchedulePolicy("lpm", cache)
    first = policy.order(waiting)
    assert policy.num_rematches == 10_000
    assert [r.queue.match_len for r in first[:5000]] == [10] * 5000  # cached groups first
    assert first[0].arrival == 0 and first[5000].queue.match_len == 0
    policy.order(waiting)
    assert policy.num_rematches == 10_000, "nothing changed: nothing re-matched"
    insert(cache, groups[3] + [1003, 7, 9])  # extends the path of exactly one request
    second = policy.order(waiting)
    # re-matched: the 100 requests at groups[3]'s node, and the 5,000 with no match at all
    # (the root changed too; their re-match is one failed dict lookup); not the other 4,900
    assert policy.num_rematches == 10_000 + 100 + 5000
    assert second[0].rid == "r3" and second[0].queue.match_len == 11  # all but the last token
    insert(cache, groups[60])  # a new group: requests at the root re-match (cheaply)
    third = policy.order(waiting)
    assert policy.num_rematches == 15_100 + 5000
    assert {
        r.queue.match_len for r in third if r.rid.endswith("60") and int(r.rid[1:]) % 100 == 60
    } == {10}
    # an eviction makes matches stale too
    cache.evict(cache.evictable_size)
    policy.order(waiting)
    assert all(r.queue.match_len == 0 for r in waiting)


def test_dfs_weight_groups_requests_sharing_prefixes():
    cache = RadixCache(SlotAllocator(1024))
    insert(cache, [1, 1, 1])
    insert(cache, [2, 2, 2])
    waiting = [
        make_req(0, [2, 2, 2, 5, 0]),
        make_req(1, [1, 1, 1, 6, 0]),
        make_req(2, [2, 2, 2, 7, 0]),
        make_req(3, [9, 9]),
    ]
    order = [r.rid for r in SchedulePolicy("dfs-weight", cache).order(waiting)]
    assert order.index("r2") == order.index("r0") + 1, order  # one subtree, together
    assert order.index("r0") < order.index("r1"), order  # the heavier subtree first
    assert set(order) == {"r0", "r1", "r2", "r3"}


def test_other_policies():
    waiting = [make_req(i, [i, i]) for i in range(4)]
    waiting[2].gen = GenerationState(SamplingParams(max_new_tokens=50), [2, 2], None, (), 64)
    assert [r.rid for r in SchedulePolicy("lof", None).order(waiting)][0] == "r2"
    assert [r.rid for r in SchedulePolicy("fcfs", None).order(waiting)] == ["r0", "r1", "r2", "r3"]
    randomized = SchedulePolicy("random", None, seed=1).order(waiting)
    assert sorted(r.rid for r in randomized) == ["r0", "r1", "r2", "r3"]


def test_fork_groups_are_admitted_together():
    from runtime.protocol import GraphHints

    def member(i, group):
        req = make_req(i, [i, i])
        req.hints = GraphHints(fork_group_id=group, fork_group_size=2)
        return req

    waiting = [
        member(0, "g1"),
        make_req(1, [1, 1]),
        member(2, "g2"),
        member(3, "g1"),
        member(4, "g2"),
    ]
    order = [r.rid for r in SchedulePolicy("fcfs", None).order(waiting)]
    assert order == ["r0", "r3", "r1", "r2", "r4"]
