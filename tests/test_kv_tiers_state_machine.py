"""Random insert / load / lock / unlock / evict / prefetch / corrupt over the radix tree with
lower KV tiers (a small host tier that spills to a disk tier).

Every token's KV is a function of its namespace and its whole prefix, so after every step the
machine can check that each cached token's KV in the pool, each host chunk and each disk chunk
holds exactly what computing that prefix would write: a load never brings back another
prefix's or another namespace's KV, and a corrupt file is a miss, never a wrong token. The
tree keeps `check_integrity()` and every slot is accounted for; locked prefixes stay cached.
"""

from __future__ import annotations

import shutil
import tempfile
import zlib

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.cache.allocator import SlotAllocator
from runtime.cache.chunks import TierLayout, root_name
from runtime.cache.factory import TierDemotion
from runtime.cache.pool import KVPool
from runtime.cache.radix import RadixCache
from runtime.cache.tiers import KVTiers

NAMESPACES = [None, "a"]
NUM_SLOTS = 96
BASES = [tuple((7 * i + b) % 5 + 1 for i in range(24)) for b in range(3)]


def kv_value(namespace, prefix: tuple[int, ...]) -> float:
    """What computing the last token of `prefix` writes (K; V is its negative)."""
    return float(zlib.crc32(repr((namespace, prefix)).encode()) % 10007)


@st.composite
def sequences(draw) -> tuple[int, ...]:
    base = draw(st.sampled_from(BASES))
    cut = draw(st.integers(0, len(base)))
    tail = draw(st.lists(st.integers(1, 3), max_size=24))
    return base[:cut] + tuple(tail) or (1,)


class TierMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 16]), policy=st.sampled_from(["lru", "graph"]))
    def setup(self, page_size, policy):
        self.ps = page_size
        self.pool = KVPool(num_layers=2, num_slots=NUM_SLOTS, num_kv_heads=1, head_dim=2)
        layout = TierLayout("random:test", 2, 1, 2, torch.float32, page_size)
        self.chunk = layout.chunk_tokens
        self.dir = tempfile.mkdtemp(prefix="flowlang-tiers-")
        self.tiers = KVTiers(
            self.pool,
            layout,
            host_bytes=3 * layout.chunk_nbytes,
            disk_dir=self.dir,
            disk_bytes=40 * (layout.chunk_nbytes + 64),
        )
        demotion = TierDemotion(self.tiers)  # what the tree evicts moves down
        allocator = SlotAllocator(NUM_SLOTS, page_size)
        self.cache = RadixCache(allocator, page_size, policy, listeners=(demotion,))
        self.locks: list[tuple[object, tuple[int, ...], object]] = []
        self.named: dict[bytes, tuple[object, tuple[int, ...]]] = {}  # chunk name -> its prefix
        self.loaded = 0

    def teardown(self):
        if hasattr(self, "tiers"):
            self.tiers.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers
    def write_kv(self, namespace, seq, start: int, slots: torch.Tensor) -> None:
        n = len(seq) - start
        values = torch.tensor([kv_value(namespace, seq[: i + 1]) for i in range(start, len(seq))])
        k = values.view(1, n, 1, 1).expand(2, n, 1, 2).contiguous()
        self.pool.write_rows(slots, k, -k)

    def remember_names(self, namespace, seq) -> None:
        self.named[root_name(self.tiers.fingerprint, namespace)] = (namespace, ())
        names = self.tiers.names(namespace, seq, len(seq))
        for i, name in enumerate(names):
            self.named[name] = (namespace, seq[: (i + 1) * self.chunk])

    def expected_rows(self, namespace, prefix, start) -> torch.Tensor:
        values = [kv_value(namespace, prefix[: i + 1]) for i in range(start, len(prefix))]
        return torch.tensor(values).view(1, -1, 1, 1).expand(2, -1, 1, 2)

    # ------------------------------------------------------------ rules
    @rule(namespace=st.sampled_from(NAMESPACES), seq=sequences(), keep_lock=st.booleans())
    def insert(self, namespace, seq, keep_lock):
        """A request: device match, then what the tiers hold past it, then compute the rest."""
        aligned = len(seq) // self.ps * self.ps
        if not aligned:
            return
        self.remember_names(namespace, seq)
        match = self.cache.match_prefix(seq, namespace)
        if match.prefix_len:
            self.cache.lock(match.position)
        slots, lock = match.indices, match.position if match.prefix_len else None
        extent = self.tiers.extent(namespace, seq, match.prefix_len, aligned)
        if not self.tiers.ready(extent):  # admission waits for the prefetch thread's reads
            self.tiers.drain()
            extent = self.tiers.extent(namespace, seq, match.prefix_len, aligned)
        computed_from = match.prefix_len
        need = aligned - match.prefix_len
        if need > self.cache.allocator.num_free_slots:
            self.cache.evict(need - self.cache.allocator.num_free_slots)
        fresh = self.cache.allocator.alloc(need) if need else slots[:0]
        if fresh is None:  # the locked tree leaves no room
            if lock is not None:
                self.cache.unlock(lock)
            return
        if extent.num_tokens:
            loaded = self.tiers.load(extent, fresh[: extent.num_tokens])
            self.loaded += loaded
            computed_from += loaded
        self.write_kv(
            namespace, seq[:aligned], computed_from, fresh[computed_from - match.prefix_len :]
        )
        done = self.cache.insert(seq[:aligned], torch.cat([slots, fresh]), namespace)
        dup = fresh[: done.prefix_len - match.prefix_len]
        if dup.numel():
            self.cache.allocator.free(dup)
        self.cache.lock(done.position)
        if lock is not None:
            self.cache.unlock(lock)
        if keep_lock:
            self.locks.append((namespace, seq[:aligned], done.position))
        else:
            self.cache.unlock(done.position)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        _, _, position = self.locks.pop(i)
        self.cache.unlock(position)

    @rule(num_tokens=st.integers(1, NUM_SLOTS))
    def evict(self, num_tokens):
        self.cache.evict(num_tokens)

    @rule(namespace=st.sampled_from(NAMESPACES), seq=sequences())
    def prefetch(self, namespace, seq):
        self.remember_names(namespace, seq)
        start = self.cache.match_prefix(seq, namespace).prefix_len
        extent = self.tiers.extent(namespace, seq, start, len(seq))
        self.tiers.prefetch(extent, self.tiers.hold_budget_chunks)
        self.tiers.drain()

    @precondition(lambda self: len(self.tiers.disk))
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "foreign"]))
    def corrupt(self, data, how):
        self.tiers.drain()
        files = sorted(self.tiers.disk.dir.glob("*.kv"))
        if not files:
            return
        path = data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if how == "flip":
            raw[-1] ^= 0xFF
        elif how == "truncate":
            raw = raw[: len(raw) // 2]
        else:  # a valid file of another chunk under this chunk's name
            other = [f for f in files if f != path]
            if not other:
                return
            raw = bytearray(other[0].read_bytes())
        path.write_bytes(bytes(raw))

    # ------------------------------------------------------------ checks
    @invariant()
    def consistent(self):
        if not hasattr(self, "tiers"):
            return
        self.tiers.drain()
        self.cache.check_integrity(num_caller_slots=0)
        self.tiers.check_integrity()
        for namespace, prefix, _ in self.locks:
            assert self.cache.match_prefix(prefix, namespace).prefix_len == len(prefix)
        for leaf in self.cache.leaves():
            namespace, path, slots = self.cache.path_of(leaf)
            k, v = self.pool.read_rows(slots)
            expected = self.expected_rows(namespace, path, 0)
            assert torch.equal(k, expected) and torch.equal(v, -expected), "wrong KV in L1"
        host = self.tiers.host
        for name, row in host.items():
            if name in self.tiers._tail_of:  # a path's partial last chunk
                prev, tokens = self.tiers._tail_of[name]
                namespace, prefix = self.named[prev]
                expected = self.expected_rows(namespace, prefix + tokens, len(prefix))
                assert torch.equal(host.data[row][0, :, : len(tokens)], expected), "tail KV"
                assert torch.equal(host.data[row][1, :, : len(tokens)], -expected), "tail KV"
                continue
            namespace, prefix = self.named[name]
            start = len(prefix) - self.chunk
            expected = self.expected_rows(namespace, prefix, start)
            assert torch.equal(host.data[row][0], expected), "wrong KV in L2"
            assert torch.equal(host.data[row][1], -expected), "wrong KV in L2"

    @invariant()
    def disk_never_wrong(self):
        """Whatever the disk tier gives back is the chunk's true KV (bad files are misses)."""
        if not hasattr(self, "tiers"):
            return
        for path in sorted(self.tiers.disk.dir.glob("*.kv"))[:4]:
            name = bytes.fromhex(path.stem)
            chunk = self.tiers.disk.read(name)
            if chunk is None:
                continue
            namespace, prefix = self.named[name]
            expected = self.expected_rows(namespace, prefix, len(prefix) - self.chunk)
            assert torch.equal(chunk[0], expected) and torch.equal(chunk[1], -expected)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(
    max_examples=80,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_the_machine_loads_from_both_tiers():
    """The rules reach the interesting states: a run that loads (not only one that evicts)."""
    machine = TierMachine()
    machine.setup(page_size=1, policy="lru")
    try:
        seq = BASES[0] + (1, 2, 3) * 6
        machine.insert(None, seq, keep_lock=False)
        machine.evict(NUM_SLOTS)  # all of it leaves L1: 2 of 2 chunks to L2 (room for 3)
        machine.insert("a", BASES[1] + (2,) * 30, keep_lock=False)  # L2 spills to disk
        machine.evict(NUM_SLOTS)
        machine.tiers.drain()
        assert len(machine.tiers.disk) > 0
        machine.insert(None, seq, keep_lock=True)
        assert machine.loaded >= 2 * machine.chunk  # both chunks back, not computed
        machine.consistent()
        machine.disk_never_wrong()
    finally:
        machine.teardown()


def test_a_load_starting_inside_a_chunk_copies_only_what_the_device_lacks():
    """page_size 1: eviction took a leaf's tail from mid-chunk; the chunk that straddles the
    cut is demoted whole (its head read from the parent), the path's partial last chunk too,
    and a later match that ends at the cut loads only what the device lacks."""
    machine = TierMachine()
    machine.setup(page_size=1, policy="lru")
    try:
        seq = BASES[2] + (3, 1) * 8  # 40 tokens: chunks [0, 16), [16, 32) and 8 more
        machine.insert(None, seq, keep_lock=False)
        machine.evict(10)  # from 30 on: chunk [16, 32) and the tail [32, 40) go below
        assert machine.cache.match_prefix(seq).prefix_len == 30
        extent = machine.tiers.extent(None, seq, 30, len(seq))
        assert (extent.start, extent.end, extent.tail_tokens) == (30, 40, 8)
        assert machine.tiers.extent(None, seq, 30, 39).end == 39  # a tail's head serves too
        assert machine.tiers.extent(None, seq[:37] + (9, 9, 9), 30, 40).end == 37
        machine.insert(None, seq, keep_lock=False)
        assert machine.loaded == 10
        machine.consistent()
    finally:
        machine.teardown()


def test_an_extent_is_cut_to_what_fits_in_whole_chunks():
    from runtime.cache.tiers import TierExtent

    extent = TierExtent(30, 1, (b"a", b"b", b"c"), (True, False, True), 16)
    assert (extent.num_tokens, extent.end) == (34, 64)
    assert [extent.within(n).end for n in (0, 1, 2, 17, 18, 33, 34, 99)] == [
        30,
        30,
        32,
        32,
        48,
        48,
        64,
        64,
    ]
    assert extent.within(18).in_host == (True, False)


def test_chunk_names_chain_over_the_whole_prefix_and_the_namespace():
    from runtime.cache.chunks import chunk_names

    ids = list(range(100))
    names = chunk_names(b"layout", None, ids, 16, 10)
    assert len(names) == 6  # whole chunks only
    assert chunk_names(b"layout", None, ids[:40], 16, 10) == names[:2]  # a prefix's names
    other = chunk_names(b"layout", None, [99] + ids[1:], 16, 10)
    assert not set(other) & set(names)  # one token differs: every later name differs
    assert not set(chunk_names(b"layout", "a", ids, 16, 10)) & set(names)
    assert not set(chunk_names(b"other", None, ids, 16, 10)) & set(names)
    memo: list[bytes] = []
    assert chunk_names(b"layout", None, ids, 16, 3, memo) == names[:3] == memo
    assert chunk_names(b"layout", None, ids, 16, 2, memo) == names[:2]  # never more than asked
    assert chunk_names(b"layout", None, ids, 16, 10, memo) == names == memo


def test_host_rows_go_leaf_first_and_held_chunks_outlast_demotions():
    from runtime.cache.tiers import HostTier

    host = HostTier(TierLayout("m", 1, 1, 2, torch.float32, 16), 4, pin_memory=False)
    for name in (b"root", b"mid", b"leaf"):
        host.take(name)
    host.touch([b"root", b"mid", b"leaf"])  # a path read root first: the leaf goes first
    assert host.take(b"x") == (3, None)  # a free row first
    assert host.take(b"y")[1][0] == b"leaf"
    host.hold(b"root")  # a queued reader will read it
    assert host.take(b"z")[1][0] == b"mid" and host.take(b"w")[1][0] == b"x"
    assert b"root" in host and host.num_held == 1
    host.hold(b"y")
    host.hold(b"z")  # a third hold is over half of 4 rows: the oldest hold lapses, goes next
    assert host.num_held == 2 and host.take(b"v")[1][0] == b"root"
    host.touch([b"y"])  # read: no longer held
    assert host.num_held == 1
    host.check_integrity()
