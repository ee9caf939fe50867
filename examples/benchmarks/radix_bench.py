"""Radix cache cost per call at 1k / 10k / 100k cached leaves (a script, not a test).

    python examples/benchmarks/radix_bench.py [--leaves 1000 10000 100000] [--calls 500]

Prints median microseconds per call of match_prefix, insert and evict, next to a baseline evict
that rebuilds a heap over every evictable leaf on each call (SGLang's method), measured in the
same run on the same tree shape. Evict calls are interleaved with (untimed) re-inserts so the
number of leaves stays at L.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time

from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache, TreeNode

SHARED_LEN, GROUP_LEN, LEAF_LEN, NUM_GROUPS = 64, 32, 16, 16


class HeapifyEvictCache(RadixCache):
    """The anchor's evict: collect all candidate leaves and heapify them on every call."""

    def evict(self, num_tokens: int) -> int:
        heap = [(self.policy.priority(n), i, n) for i, n in enumerate(self._candidates.nodes())]
        heapq.heapify(heap)
        victims: list[TreeNode] = []
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self._candidates.discard(node)
            victims.append(node)
            num_evicted += len(node.key)
            parent = self._unlink_leaf(node)
            if parent is not None:
                self._candidates.add(parent)
                heapq.heappush(heap, (self.policy.priority(parent), -len(victims), parent))
        self._release(victims)
        return num_evicted


class Workload:
    """Sequences: one shared system prefix, NUM_GROUPS group prefixes, unique leaf tails."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.shared = self._tokens(SHARED_LEN)
        self.groups = [self._tokens(GROUP_LEN) for _ in range(NUM_GROUPS)]

    def _tokens(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(100_000) for _ in range(n))

    def sequence(self) -> tuple[int, ...]:
        return self.shared + self.rng.choice(self.groups) + self._tokens(LEAF_LEN)


def build(cls: type[RadixCache], num_leaves: int, seed: int) -> tuple[RadixCache, Workload, list]:
    num_slots = (num_leaves + 4096) * LEAF_LEN + SHARED_LEN + NUM_GROUPS * GROUP_LEN
    cache = cls(SlotAllocator(num_slots))
    work = Workload(seed)
    sequences = []
    for _ in range(num_leaves):
        insert(cache, seq := work.sequence())
        sequences.append(seq)
    return cache, work, sequences


def insert(cache: RadixCache, seq: tuple[int, ...]) -> float:
    slots = cache.allocator.alloc(len(seq))
    start = time.perf_counter()
    prefix_len = cache.insert(seq, slots).prefix_len
    elapsed = time.perf_counter() - start
    cache.allocator.free(slots[:prefix_len])
    return elapsed


def time_evicts(cache: RadixCache, work: Workload, num_calls: int) -> list[float]:
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        num_evicted = cache.evict(LEAF_LEN)
        times.append(time.perf_counter() - start)
        assert num_evicted >= LEAF_LEN
        insert(cache, work.sequence())
    return times


def measure(num_leaves: int, num_calls: int) -> dict[str, float]:
    cache, work, sequences = build(RadixCache, num_leaves, seed=num_leaves)
    rng = random.Random(0)
    match_times = []
    for seq in rng.choices(sequences, k=num_calls):
        start = time.perf_counter()
        cache.match_prefix(seq)
        match_times.append(time.perf_counter() - start)
    insert_times = [insert(cache, work.sequence()) for _ in range(num_calls)]
    evict_times = time_evicts(cache, work, num_calls)
    cache.check_integrity(num_caller_slots=0)
    assert cache.num_candidates >= num_leaves

    baseline, base_work, _ = build(HeapifyEvictCache, num_leaves, seed=num_leaves)
    baseline_calls = max(20, num_calls // 10) if num_leaves >= 50_000 else num_calls
    baseline_times = time_evicts(baseline, base_work, baseline_calls)
    baseline.check_integrity(num_caller_slots=0)

    def us(xs: list[float]) -> float:
        return statistics.median(xs) * 1e6

    return {
        "leaves": num_leaves,
        "match": us(match_times),
        "insert": us(insert_times),
        "evict": us(evict_times),
        "baseline": us(baseline_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--calls", type=int, default=500)
    args = parser.parse_args()
    rows = [measure(n, args.calls) for n in args.leaves]
    print(
        f"\nradix cache, median us per call ({args.calls} calls; evicts take one "
        f"{LEAF_LEN}-token leaf; sequences {SHARED_LEN}+{GROUP_LEN}+{LEAF_LEN} tokens)\n"
    )
    print(
        "| cached leaves | match_prefix | insert | evict (ours) | evict (heapify baseline) "
        "| baseline / ours |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['leaves']:,} | {r['match']:.1f} | {r['insert']:.1f} | {r['evict']:.1f} | "
            f"{r['baseline']:.1f} | {r['baseline'] / r['evict']:.0f}x |"
        )
    first, last = rows[0], rows[-1]
    ours, base = last["evict"] / first["evict"], last["baseline"] / first["baseline"]
    print(
        f"\nevict growth {last['leaves']:,} vs {first['leaves']:,} leaves: ours {ours:.2f}x, "
        f"baseline {base:.1f}x"
    )


if __name__ == "__main__":
    main()
