"""KV cache events: a tree rebuilt from the event stream equals the engine's tree at every step.

A hypothesis machine drives insert / lock / unlock / evict / reset on a real RadixCache (with
namespaces, page sizes 1 and 16, small pools so eviction cascades) while a MirrorTree follows
the events; after every step the tree passes `check_integrity()` and both trees hold the same
paths. A subscriber that joins late (snapshot + events) must agree too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.cache.allocator import SlotAllocator
from runtime.cache.events import KVEvent, KVEventPublisher, KVEventsLostError
from runtime.cache.radix import RadixCache
from runtime.cluster.mirror import MirrorDesyncError, MirrorTree

NAMESPACES = [None, "a"]
NUM_PAGES = {1: 40, 16: 10}


def engine_leaf_paths(cache: RadixCache) -> dict:
    """Maximal cached paths per namespace, read from the tree itself."""
    return leaf_paths_of_edges(cache.edge_paths())


def leaf_paths_of_edges(edges) -> dict:
    """Every edge's path minus the paths that are some edge's parent (no MirrorTree code)."""
    paths: dict = {}
    parents: dict = {}
    for namespace, path, start_len in edges:
        paths.setdefault(namespace, set()).add(path)
        parents.setdefault(namespace, set()).add(path[:start_len])
    return {ns: frozenset(p - parents[ns]) for ns, p in paths.items()}


@st.composite
def sequences(draw, page_size: int) -> tuple[int, ...]:
    if page_size == 1:
        return tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=12)))
    base = tuple(range(page_size))
    pages = [base, base[:-1] + (99,), tuple(range(100, 100 + page_size))]
    chosen = draw(st.lists(st.sampled_from(pages), min_size=1, max_size=4))
    tail = draw(st.lists(st.integers(0, 3), max_size=page_size - 1))
    return tuple(t for page in chosen for t in page) + tuple(tail)


class EventMirrorMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 16]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page_size, policy):
        self.ps = page_size
        allocator = SlotAllocator(NUM_PAGES[page_size] * page_size, page_size)
        self.publisher = KVEventPublisher()
        self.cache = RadixCache(allocator, page_size, policy, listeners=(self.publisher,))
        self.sub = self.publisher.subscribe(self.cache.edge_paths(), 10_000)
        self.mirror = MirrorTree(page_size)
        self.mirror.load(self.sub.snapshot)
        self.locks: list = []
        self.num_steps = 0

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES), lock=st.booleans())
    def insert(self, data, ns, lock):
        seq = data.draw(sequences(self.ps))
        matched = self.cache.match_prefix(seq, ns)
        need = -(-len(seq) // self.ps) * self.ps - matched.prefix_len
        if not self.cache.allocator.can_alloc(need):
            self.cache.lock(matched.position)  # keep what we reuse while evicting
            self.cache.evict(need - self.cache.allocator.num_free_slots)
            self.cache.unlock(matched.position)
            if not self.cache.allocator.can_alloc(need):
                return
        slots = torch.cat([matched.indices, self.cache.allocator.alloc(need)])
        result = self.cache.insert(seq, slots[: len(seq)], ns)
        aligned = len(seq) // self.ps * self.ps
        self.cache.allocator.free(slots[matched.prefix_len : result.prefix_len])  # duplicates
        self.cache.allocator.free(slots[aligned:])  # the caller's unaligned tail page
        if lock and result.position.prefix_len:
            self.cache.lock(result.position)
            self.locks.append(result.position)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        position = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(position)

    @rule(num_tokens=st.integers(1, 64))
    def evict(self, num_tokens):
        self.cache.evict(num_tokens)

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()

    @invariant()
    def mirror_matches(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        self.mirror.apply_all(self.sub.poll())
        assert self.mirror.last_seq == self.publisher.seq
        assert self.mirror.leaf_paths() == engine_leaf_paths(self.cache)
        assert self.mirror.num_tokens == self.cache.total_size
        self.num_steps += 1
        if self.num_steps % 5 == 0:  # a late subscriber: snapshot, then the same stream
            late = self.publisher.subscribe(self.cache.edge_paths(), 10_000)
            fresh = MirrorTree(self.ps)
            fresh.load(late.snapshot)
            assert fresh.leaf_paths() == self.mirror.leaf_paths()
            late.close()


TestEventMirror = EventMirrorMachine.TestCase
TestEventMirror.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_event_json_round_trip_and_bad_kind():
    event = KVEvent(7, "removed", "ns", (1, 2, 3), 1)
    assert KVEvent.from_dict(event.to_dict()) == event
    with pytest.raises(ValueError, match="unknown KV event kind"):
        KVEvent.from_dict({**event.to_dict(), "kind": "split"})


def test_gap_in_sequence_is_a_desync():
    mirror = MirrorTree()
    mirror.apply(KVEvent(1, "stored", None, (1, 2), 0))
    with pytest.raises(MirrorDesyncError, match="events lost"):
        mirror.apply(KVEvent(3, "stored", None, (1, 2, 3), 2))


def test_removed_path_that_is_not_cached_is_a_desync():
    mirror = MirrorTree()
    mirror.apply(KVEvent(1, "stored", None, (1, 2, 3), 0))
    with pytest.raises(MirrorDesyncError):
        mirror.apply(KVEvent(2, "removed", None, (1, 2, 4), 2))


def test_slow_reader_is_told_it_lost_events():
    publisher = KVEventPublisher()
    sub = publisher.subscribe((), max_pending_events=3)
    for i in range(4):
        publisher.emit("stored", None, (i,), 0)
    with pytest.raises(KVEventsLostError, match="subscribe again"):
        sub.poll()


def test_no_subscriber_spends_no_sequence_numbers():
    publisher = KVEventPublisher()
    publisher.emit("stored", None, (1,), 0)
    assert publisher.seq == 0


# ---------------------------------------------------------------- through the engine
def test_engine_event_stream_rebuilds_its_tree_at_every_step():
    """Requests in two namespaces on a pool small enough to evict; after each one the mirror
    fed by `subscribe_kv_events` holds exactly the engine's cached paths (a fresh snapshot)."""
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    shared = list(range(10, 90))
    with Engine(EngineConfig(model="random:tiny", max_kv_tokens=384)) as engine:
        sub = engine.subscribe_kv_events()
        mirror = MirrorTree()
        mirror.load(sub.snapshot)
        kinds: set[str] = set()
        for i in range(8):
            prompt = shared + [100 + i] * (20 + 7 * i)
            request = GenerateRequest(
                input_ids=prompt,
                sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
                namespace="tenant" if i % 3 == 0 else None,
            )
            (result,) = engine.generate(request)
            assert result.finish_reason == "length", result.error
            engine.check_integrity()
            events = sub.poll()
            kinds.update(e.kind for e in events)
            mirror.apply_all(events)
            truth = engine.subscribe_kv_events()  # a snapshot read from the tree itself
            truth.close()
            edges = [(e.namespace, e.token_ids, e.start_len) for e in truth.snapshot.stored]
            assert mirror.last_seq == truth.snapshot.seq
            assert mirror.leaf_paths() == leaf_paths_of_edges(edges)
        assert {"stored", "removed"} <= kinds  # the pool was small enough to evict
        engine.flush_cache()
        mirror.apply_all(sub.poll())
        assert mirror.num_tokens == 0
    assert sub.closed  # closing the engine ends its subscriptions


def test_http_stream_sends_snapshot_then_events():
    """GET /v1/flowlang/kv_events: a snapshot line, then the stored events of a request."""
    import json

    import httpx
    from conftest import ServerThread

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    thread = ServerThread(Engine(EngineConfig(model="random:tiny", max_kv_tokens=512)))
    try:
        with httpx.Client(base_url=thread.url, timeout=60) as client:
            with client.stream("GET", "/v1/flowlang/kv_events") as stream:
                lines = stream.iter_lines()
                first = json.loads(next(lines))
                assert first["snapshot"] == 0 and first["stored"] == []
                body = {"input_ids": list(range(1, 40)), "sampling": {"max_new_tokens": 3}}
                reply = client.post("/v1/flowlang/generate", json=body)
                assert reply.status_code == 200, reply.text
                event = KVEvent.from_dict(json.loads(next(lines)))
        assert event.seq == 1 and event.kind == "stored"
        assert event.token_ids[:39] == tuple(range(1, 40))
    finally:
        thread.stop()


def test_http_stream_names_its_replica_and_needs_an_admin_key():
    """One engine is replica 0 (?replica=1 is a 400 naming it); with API keys, the stream
    (every tenant's token paths) needs an admin key: a plain key is a 403."""
    import json

    import httpx
    from conftest import ServerThread

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    engine = Engine(EngineConfig(model="random:tiny", max_kv_tokens=512))
    thread = ServerThread(engine, api_keys=("user",), admin_keys=("boss",))
    try:
        with httpx.Client(base_url=thread.url, timeout=60) as client:
            route = "/v1/flowlang/kv_events"
            user = {"Authorization": "Bearer user"}
            admin = {"Authorization": "Bearer boss"}
            refused = client.get(route, headers=user)
            assert refused.status_code == 403 and "admin key" in refused.text
            assert client.get(route).status_code == 401
            wrong = client.get(route, params={"replica": 1}, headers=admin)
            assert wrong.status_code == 400 and "replica 0" in wrong.text
            with client.stream("GET", route, params={"replica": 0}, headers=admin) as stream:
                assert json.loads(next(stream.iter_lines()))["snapshot"] == 0
    finally:
        thread.stop()
