"""Random insert / match / lock / unlock / evict against a plain reference model.

The reference keeps, per namespace, a dict from every cached page-aligned prefix (a tuple) to
the slots of its last page. After every step the tree must agree with it, keep every invariant of
`check_integrity()`, never evict a locked prefix, and account for every slot.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.cache.allocator import SlotAllocator
from runtime.cache.eviction import EVICTION_POLICIES
from runtime.cache.graph_policy import CONTINUATION, QUEUED_READ, RETURNING, GraphPolicy, NextUse
from runtime.cache.radix import RadixCache

NAMESPACES = [None, "a", "b"]


def _subtree(root):
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


NUM_PAGES = {1: 48, 16: 12}  # small pools, so inserts hit pressure and evict


def _pages(page_size: int) -> list[tuple[int, ...]]:
    """Pages that share prefixes and differ mid-page, so matches must round down."""
    base = tuple(range(page_size))
    return [base, base[:-1] + (99,), tuple(range(100, 100 + page_size))]


@st.composite
def sequences(draw, page_size: int) -> tuple[int, ...]:
    if page_size == 1:
        return tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=12)))
    pages = draw(st.lists(st.sampled_from(_pages(page_size)), max_size=5))
    tail = draw(st.lists(st.integers(0, 3), max_size=page_size - 1))
    seq = tuple(t for page in pages for t in page) + tuple(tail)
    return seq or (0,)


class RadixMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 16]), policy=st.sampled_from(sorted(EVICTION_POLICIES))
    )
    def setup(self, page_size, policy):
        self.ps = page_size
        allocator = SlotAllocator(NUM_PAGES[page_size] * page_size, page_size)
        self.cache = RadixCache(allocator, page_size, policy)
        self.ref: dict[object, dict[tuple[int, ...], list[int]]] = {ns: {} for ns in NAMESPACES}
        self.locks: list[tuple[object, tuple[int, ...], object]] = []  # (ns, prefix, position)
        self.matches: list[tuple[object, tuple[int, ...], object]] = []  # unlocked positions
        self.watched: list = []  # earlier matches whose staleness the tree must report

    # ------------------------------------------------------------ reference
    def ref_match_len(self, ns, seq) -> int:
        table, n = self.ref[ns], 0
        while n + self.ps <= len(seq) and seq[: n + self.ps] in table:
            n += self.ps
        return n

    def ref_indices(self, ns, seq, n) -> list[int]:
        return [s for i in range(self.ps, n + 1, self.ps) for s in self.ref[ns][seq[:i]]]

    def page_prefixes(self, ns, prefix) -> set[tuple[object, tuple[int, ...]]]:
        return {(ns, prefix[:i]) for i in range(self.ps, len(prefix) + 1, self.ps)}

    def locked_prefixes(self) -> set[tuple[object, tuple[int, ...]]]:
        return {pp for ns, p, _ in self.locks for pp in self.page_prefixes(ns, p)}

    # ------------------------------------------------------------ rules
    @rule(
        data=st.data(),
        ns=st.sampled_from(NAMESPACES),
        reuse=st.booleans(),
        priority=st.integers(0, 3),
    )
    def insert(self, data, ns, reuse, priority):
        seq = data.draw(sequences(self.ps))
        n_alloc = -(-len(seq) // self.ps) * self.ps
        matched = self.cache.match_prefix(seq, ns) if reuse else None
        need = n_alloc - (matched.prefix_len if matched else 0)
        if not self.cache.allocator.can_alloc(need):
            if matched:
                self.cache.lock(matched.position)  # keep what we reuse while evicting
            self.cache.evict(need - self.cache.allocator.num_free_slots)
            self.sync_after_evict()
            if matched:
                self.cache.unlock(matched.position)
            if not self.cache.allocator.can_alloc(need):
                return
        new = self.cache.allocator.alloc(need)
        slots = torch.cat([matched.indices, new]) if matched else new
        expected = self.ref_match_len(ns, seq)
        prefix_len = self.cache.insert(seq, slots[: len(seq)], ns, priority).prefix_len
        assert prefix_len == expected
        aligned = len(seq) // self.ps * self.ps
        for i in range(prefix_len + self.ps, aligned + 1, self.ps):
            self.ref[ns][seq[:i]] = slots[i - self.ps : i].tolist()
        own_start = matched.prefix_len if matched else 0
        self.cache.allocator.free(slots[own_start:prefix_len])  # duplicates
        self.cache.allocator.free(slots[aligned:])  # the caller's unaligned tail page
        assert self.cache.match_prefix(seq, ns).prefix_len == aligned

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def match(self, data, ns):
        seq = data.draw(sequences(self.ps))
        num_nodes = self.cache.num_nodes
        result = self.cache.match_prefix(seq, ns)
        n = self.ref_match_len(ns, seq)
        assert result.prefix_len == n
        assert result.indices.tolist() == self.ref_indices(ns, seq, n)
        assert self.cache.num_nodes == num_nodes, "match must not split"
        self.matches.append((ns, seq[:n], result.position))
        self.watched = [
            *self.watched[-15:],
            (ns, seq, n, result.position, result.position.node.version),
        ]

    @precondition(lambda self: self.matches)
    @rule(data=st.data())
    def lock_earlier_match(self, data):
        """Lock a position taken before later inserts may have split its edge."""
        ns, prefix, pos = self.matches.pop(data.draw(st.integers(0, len(self.matches) - 1)))
        unlocked = self.cache.unlocked_tokens(pos)  # what admission counts as the reader's own
        delta = self.cache.lock(pos)
        newly = self.page_prefixes(ns, prefix) - self.locked_prefixes()
        assert -delta == len(newly) * self.ps == unlocked
        self.locks.append((ns, prefix, pos))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        ns, prefix, pos = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        delta = self.cache.unlock(pos)
        freed = self.page_prefixes(ns, prefix) - self.locked_prefixes()
        assert delta == len(freed) * self.ps

    @rule(num_tokens=st.integers(0, 300))
    def evict(self, num_tokens):
        evictable = self.cache.evictable_size
        num_evicted = self.cache.evict(num_tokens)
        removed = self.sync_after_evict()
        assert num_evicted == removed
        wanted = -(-num_tokens // self.ps) * self.ps  # whole pages
        assert num_evicted == min(wanted, evictable), "evicted more than asked, or stopped early"

    @rule(
        data=st.data(),
        future=st.one_of(
            st.none(),
            st.builds(
                NextUse, st.sampled_from([RETURNING, CONTINUATION, QUEUED_READ]), st.integers(-9, 0)
            ),
        ),
    )
    def set_future(self, data, future):
        """What graph marks write, on any node, locked or not: `wanted_size` must follow it
        through later locks, splits and evictions (check_integrity recounts it)."""
        nodes = [n for root in self.cache.roots().values() for n in _subtree(root)]
        policy = self.cache.policy  # (only the graph policy keeps futures)
        if nodes and isinstance(policy, GraphPolicy):
            node = data.draw(st.sampled_from(nodes))
            if policy.set_future(node, future):
                self.cache.reprioritize(node)

    # ------------------------------------------------------------ checks
    def sync_after_evict(self) -> int:
        """Drop evicted prefixes from the reference, checking what eviction may take."""
        self.matches.clear()  # unlocked positions may be stale now
        locked = self.locked_prefixes()
        removed = 0
        for ns, table in self.ref.items():
            gone = [p for p in table if self.cache.match_prefix(p, ns).prefix_len < len(p)]
            for p in gone:
                assert (ns, p) not in locked, "a locked prefix was evicted"
                slots = torch.tensor(table.pop(p))
                assert not self.cache.allocator.all_allocated(slots), "evicted slots not freed"
            removed += len(gone) * self.ps
        return removed

    @invariant()
    def agrees_with_reference(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(num_caller_slots=0)
        assert self.cache.total_size == sum(map(len, self.ref.values())) * self.ps
        assert self.cache.protected_size == len(self.locked_prefixes()) * self.ps
        for ns, prefix, _ in self.locks:
            assert self.cache.match_prefix(prefix, ns).prefix_len == len(prefix)
        for ns, seq, n, pos, version in self.watched:
            if self.cache.match_is_current(pos, version):  # else the caller re-matches
                assert self.cache.match_prefix(seq, ns).prefix_len == n, "stale match undetected"


RadixMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixMachine = RadixMachine.TestCase
