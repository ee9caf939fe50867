"""Hostile testing, fourth round (issue 50), per-tenant engine state: cache namespaces are
bounded in length and their roots go when they empty (#4); a graph hint is advice within its
owner's share of the pool, never a reservation that holds another tenant (#5); declared
returns are capped and the returning-branches table is bounded per owner (#10)."""

from __future__ import annotations

import httpx
import pytest
from conftest import ServerThread
from pydantic import ValidationError

from runtime.cache.allocator import SlotAllocator
from runtime.cache.radix import RadixCache
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.protocol import GenerateRequest, GraphHints, SamplingParams

ONE = SamplingParams(max_new_tokens=1, temperature=0)


def engine_for(model_dir, **overrides) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), max_kv_tokens=4096, **overrides))


def on_loop(engine: Engine, fn):
    """`fn()` run on the engine's loop thread (the scheduler's state is its own)."""
    return engine._call_in_loop(fn)


# ---------------------------------------------------------------- #4 namespaces
def test_a_namespace_root_goes_when_its_last_token_is_evicted():
    cache = RadixCache(SlotAllocator(num_slots=256))
    for i in range(50):
        cache.insert([i, i + 1, i + 2], cache.allocator.alloc(3), namespace=f"tenant/{i}")
    assert len(cache.roots()) == 51
    cache.check_integrity()
    cache.evict(cache.evictable_size)  # what flush_cache does
    assert list(cache.roots()) == [None], "emptied namespaces kept their roots"
    cache.check_integrity(num_caller_slots=0)


def test_a_read_of_an_unknown_namespace_makes_no_root():
    cache = RadixCache(SlotAllocator(num_slots=64))
    for i in range(20):
        assert cache.match_prefix([1, 2, 3], namespace=f"probe-{i}").prefix_len == 0
    cache.insert([1, 2], cache.allocator.alloc(2), namespace="x" * 8)  # a one-page miss:
    assert set(cache.roots()) == {None, "x" * 8}
    cache.check_integrity()


def test_a_match_taken_before_its_namespace_existed_sees_the_insert():
    """A waiting request matched an empty namespace; a later insert there must make its match
    stale (so it is matched again and reads the new tokens), and locking the old, empty match
    is harmless."""
    cache = RadixCache(SlotAllocator(num_slots=64))
    old = cache.match_prefix([5, 6, 7], namespace="late")
    version = old.position.node.version
    cache.insert([5, 6, 7], cache.allocator.alloc(3), namespace="late")
    assert not cache.match_is_current(old.position, version)
    assert cache.lock(old.position) == 0 and cache.unlock(old.position) == 0
    assert cache.match_prefix([5, 6, 7], namespace="late").prefix_len == 3
    cache.evict(3)
    assert "late" not in cache.roots()
    assert cache.match_prefix([5, 6, 7], namespace="late").prefix_len == 0
    cache.check_integrity(num_caller_slots=0)


def test_live_namespaces_are_capped_per_owner(monkeypatch):
    """Past the cap, an owner's new namespace caches nothing (its tokens stay the caller's);
    another owner is unaffected, and an emptied namespace frees its place."""
    import runtime.cache.radix as radix

    monkeypatch.setattr(radix, "MAX_NAMESPACES_PER_OWNER", 4, raising=False)
    cache = RadixCache(SlotAllocator(num_slots=256))
    held = []
    for i in range(6):
        slots = cache.allocator.alloc(3)
        done = cache.insert([7, 8, i], slots, namespace=f"ka/{i}")
        if done.position.prefix_len == 0:
            held.append(slots)  # not taken: the caller frees them
    assert len(held) == 2 and len([ns for ns in cache.roots() if ns]) == 4
    assert cache.insert([1, 2], cache.allocator.alloc(2), "kb").position.prefix_len == 2
    cache.check_integrity(num_caller_slots=6)
    for slots in held:
        cache.allocator.free(slots)
    cache.evict(3)  # one of ka's namespaces empties: a new one may take its place
    assert cache.insert([9], cache.allocator.alloc(1), "ka/new").position.prefix_len == 1
    cache.check_integrity(num_caller_slots=0)


def test_engine_refuses_long_namespaces_and_flush_drops_the_rest(tiny_model_dir):
    with engine_for(tiny_model_dir) as engine:
        long = GenerateRequest(input_ids=[1, 2, 3], sampling=ONE, namespace="n" * 5000)
        with pytest.raises(InvalidRequestError, match="at most 1024"):
            engine.submit(long).result(timeout=60)
        with pytest.raises(InvalidRequestError, match="at most 1024"):
            engine.pin([1, 2, 3, 4], namespace="p" * 5000)
        requests = [
            GenerateRequest(input_ids=[1, 2, 3, 4, 5], sampling=ONE, namespace=f"salt-{i}")
            for i in range(30)
        ]
        for handle in engine.submit_many(requests):
            assert handle.result(timeout=60).finish_reason == "length"
        roots = on_loop(engine, lambda: len(engine.scheduler.kv.cache.roots()))
        assert roots == 31
        engine.flush_cache()
        assert on_loop(engine, lambda: list(engine.scheduler.kv.cache.roots())) == [None]
        engine.check_integrity()


def test_http_namespace_fields_are_bounded(tiny_model_dir):
    server = ServerThread(engine_for(tiny_model_dir), api_keys=("user-key",))
    auth, model = {"Authorization": "Bearer user-key"}, str(tiny_model_dir)
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=auth) as client:
            bodies = [
                ("/generate", {"text": "hi", "cache_salt": "s" * 3000}),
                ("/generate", {"text": "hi", "extra_key": "e" * 3000}),
                ("/v1/completions", {"model": model, "prompt": "hi", "cache_salt": "c" * 3000}),
                ("/v1/completions", {"model": model, "prompt": "hi", "namespace": "n" * 3000}),
            ]
            for route, body in bodies:
                body = {**body, "max_tokens": 1} if route.startswith("/v1") else body
                if route == "/generate":
                    body["sampling_params"] = {"max_new_tokens": 1}
                reply = client.post(route, json=body)
                assert reply.status_code == 400, (route, reply.text)
                assert "1024" in reply.text, reply.text
            body = {"text": "hi", "cache_salt": "s" * 500, "sampling_params": {"max_new_tokens": 1}}
            ok = client.post("/generate", json=body)
            assert ok.status_code == 200, ok.text
    finally:
        server.stop()
        server.engine.close()


# ---------------------------------------------------------------- #5 hints are advice
def test_hint_fields_are_bounded():
    with pytest.raises(ValidationError):
        GraphHints(continuation=True, future_tokens=10**12)
    with pytest.raises(ValidationError):
        GraphHints(continuation=True, next_turn_after_s=float("inf"))
    with pytest.raises(ValidationError):
        GraphHints(program_id="p" * 5000)
    assert GraphHints(continuation=True, future_tokens=10**9).future_tokens == 10**9


def test_a_huge_future_tokens_hint_holds_no_other_tenant(tiny_model_dir, step_counter):
    """One tenant's running request hints 1e9 future tokens under graph eviction; another
    tenant's 1-token request is admitted and done within a few engine steps, long before the
    hinting request finishes (counted in steps, not seconds)."""
    long_run = SamplingParams(max_new_tokens=600, ignore_eos=True, temperature=0)
    hint = GraphHints(program_id="p", continuation=True, future_tokens=10**9)
    hog = GenerateRequest(input_ids=[1, 2, 3, 4], sampling=long_run, hints=hint, namespace="ka")
    other = GenerateRequest(input_ids=[9, 8, 7, 6], sampling=ONE, namespace="kb/salt")
    with engine_for(tiny_model_dir, eviction_policy="graph") as engine:
        hog_handle = engine.submit(hog)
        first = next(iter(hog_handle.chunks()))  # the hog is running
        assert first.num_output_tokens >= 1
        start = step_counter.now()
        result = engine.submit(other).result(timeout=120)
        took = step_counter.now() - start
        assert result.finish_reason == "length"
        assert took <= 30, f"the other tenant waited {took} steps behind a hint"
        assert engine.stats()["admissions_held_total"] <= 30
        hog_handle.cancel()


# ---------------------------------------------------------------- #10 returning branches
def test_returning_branches_are_capped_per_owner_and_in_time(tiny_model_dir, monkeypatch):
    import runtime.scheduler.branches as branches_module

    monkeypatch.setattr(branches_module, "MAX_BRANCHES_PER_OWNER", 8)
    with engine_for(tiny_model_dir, eviction_policy="graph", host_kv_gb=0.01) as engine:
        requests = [
            GenerateRequest(
                input_ids=[1, 2, 3, 4, 5, 6, 7, 8, i + 10],
                sampling=ONE,
                namespace="ka/s",
                hints=GraphHints(program_id=f"p{i}", continuation=True, next_turn_after_s=1e9),
            )
            for i in range(40)
        ]
        for handle in engine.submit_many(requests):
            assert handle.result(timeout=60).finish_reason == "length"
        ahead = engine.scheduler.lookahead
        table = on_loop(engine, lambda: [e[0] - ahead.now_s for e in ahead.returning.values()])
        assert len(table) == 8, f"{len(table)} returning branches kept for one owner"
        # now + horizon - now rounds to within a few ulps of the horizon, never past it by more
        assert max(table) <= 86_400.0 + 1e-6, "a declared return past the horizon was kept as is"
        other = GenerateRequest(
            input_ids=[3, 3, 3, 3],
            sampling=ONE,
            namespace="kb",
            hints=GraphHints(program_id="q", continuation=True, next_turn_after_s=5.0),
        )
        engine.submit(other).result(timeout=60)  # another owner's entry displaces nothing
        assert on_loop(engine, lambda: len(ahead.returning)) == 9
        engine.check_integrity()


def test_the_draft_index_forgets_namespaces_that_left_the_tree():
    """Finding 4 with `--speculative tree`: the token index gave every namespace an id for
    good; a namespace whose last slot is evicted is forgotten like its tree root."""
    from runtime.cache.allocator import SlotAllocator
    from runtime.cache.radix import RadixCache
    from runtime.cache.token_index import TokenIndex

    index = TokenIndex(64)
    cache = RadixCache(SlotAllocator(64, 1), 1, listeners=(index,))
    for i in range(40):
        slots = cache.allocator.alloc(5)
        cache.insert([7, 8, 9, 1, i], slots, f"a/tenant-{i}")
        cache.evict(64)
        cache.check_integrity(num_caller_slots=0)
        index.check_integrity()
    assert index.num_spaces == 0
    slots = cache.allocator.alloc(5)
    cache.insert([7, 8, 9, 1, 2], slots, "a/kept")
    assert index.num_spaces == 1
    assert index.continuation("a/kept", [7, 8, 9], 2) == (3, [1, 2])
    assert index.continuation("a/tenant-3", [7, 8, 9], 2) == (0, [])
