"""The router without Ray: policies, event-fed exactness, namespaces, pins, dead replicas, and
computed-token counts of each policy and of graph-aware placement on simulated replicas."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cluster.placement import Instance, place_batch
from runtime.cluster.policy import RouterConfig, choose_cache_aware, is_imbalanced
from runtime.cluster.router import NoReplicaError, Router
from runtime.cluster.simulate import SimReplica, simulate
from runtime.prefix import prefill_lower_bound

SHARED = tuple(range(1000, 1400))  # a 400-token system prompt every user shares


def _router(policy: str, num_replicas: int = 2, **config) -> Router:
    router = Router(RouterConfig(policy=policy, **config))
    for index in range(num_replicas):
        router.add_replica(index)
    return router


# ---------------------------------------------------------------- the rule
def test_imbalance_needs_both_thresholds():
    config = RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    assert not is_imbalanced([10, 6], config)  # spread 4 is not > 4
    assert is_imbalanced([11, 6], config)
    assert not is_imbalanced([104, 99], config)  # spread 5 but 104 < 1.5 * 99


def test_cache_aware_prefers_match_then_load_then_guard():
    config = RouterConfig(balance_abs_threshold=4, min_match_tokens=32, guard_slack=1)
    none = [0, 0]

    def choose(matches, loads, evictions=none, prompt_len=100):
        return choose_cache_aware(matches, loads, evictions, prompt_len, config)

    assert choose([0, 40], [3, 0]) == 1
    assert choose([40, 40], [3, 1]) == 1  # tie: less loaded
    assert choose([0, 0], [3, 1]) == 1  # no match: least loaded
    assert choose([40, 0], [2, 0]) == 0  # 40 tokens saved: the match
    assert choose([20, 0], [2, 0]) == 1  # a stray 20: load decides
    # imbalanced (9 vs 0): the overloaded replica is not priced, whatever it caches
    assert choose([90, 0], [9, 0]) == 1
    # ... but a lightly loaded one (within guard_slack of the min) still is: its match wins
    assert choose_cache_aware([90, 80, 0], [9, 1, 0], [0, 0, 0], 100, config) == 1
    assert choose_cache_aware([90, 80, 0], [9, 2, 0], [0, 0, 0], 100, config) == 2


def test_cache_aware_prices_what_admission_would_evict():
    """A 40-token match that makes its replica evict 50 cached tokens costs more than
    computing the whole prompt on a replica with room; evicting 30 is worth the 40."""
    config = RouterConfig(min_match_tokens=32)
    assert choose_cache_aware([40, 0], [1, 1], [50, 0], 100, config) == 1
    assert choose_cache_aware([40, 0], [1, 1], [30, 0], 100, config) == 0
    # the router's side: cached + being computed + the new tokens against the pool
    router = Router(RouterConfig(min_match_tokens=8))
    router.add_replica(0, capacity_tokens=100)
    router.add_replica(1, capacity_tokens=100)
    shared = tuple(range(1, 41))
    assert router.route("a", shared + (50,) * 50) == 0  # 90 tokens being computed on 0
    # on 0: 60 new + 50 evicted = 110; on 1: 100 new, nothing evicted
    assert router.route("b", shared + (60,) * 60) == 1
    # on 0: 1 new, room for it; on 1: 1 new + 1 evicted
    assert router.route("c", shared + (70,)) == 0
    router.finish("a")
    assert router.route("d", shared + (80,) * 60) == 0  # 0 has room again


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(policy="fastest")


def test_round_robin_and_least_loaded():
    router = _router("round_robin", 3)
    assert [router.route(f"r{i}", [1]) for i in range(4)] == [0, 1, 2, 0]
    router = _router("least_loaded", 2)
    assert [router.route(f"r{i}", [1]) for i in range(3)] == [0, 1, 0]
    router.finish("r0")
    router.finish("r2")
    assert router.route("r3", [1]) == 0


# ---------------------------------------------------------------- exact, event-fed trees
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 1),
            st.sampled_from([None, "t"]),
            st.lists(st.integers(1, 3), min_size=1, max_size=10),
        ),
        max_size=30,
    )
)
def test_router_match_equals_the_replica_tree(ops):
    """After any inserts (and the evictions a 24-slot pool forces), the router's match on each
    replica is exactly what that replica's cache matches."""
    replicas = [SimReplica(max_kv_tokens=24) for _ in range(2)]
    router = _router("cache_aware")
    for index, namespace, ids in ops:
        replicas[index].finish(namespace, tuple(ids))
        router.apply_events(index, replicas[index].subscription.poll())
        for replica in replicas:
            replica.cache.check_integrity()
        for probe_ns in (None, "t"):
            expected = {
                i: r.cache.match_prefix(tuple(ids), probe_ns).prefix_len
                for i, r in enumerate(replicas)
            }
            assert router.match_lens(ids, probe_ns) == expected


def test_cache_aware_follows_events_and_namespaces():
    replica = SimReplica(max_kv_tokens=1000)
    router = _router("cache_aware")
    router.resync(1, replica.subscription.snapshot)
    replica.finish(None, SHARED)
    router.apply_events(1, replica.subscription.poll())
    assert router.route("a", SHARED + (5,)) == 1
    router.finish("a")
    assert router.route("b", SHARED + (5,), namespace="other") == 0  # no sharing across
    replica.cache.evict(10_000)  # the replica dropped it: the router hears so
    router.apply_events(1, replica.subscription.poll())
    router.finish("b")
    assert router.match_lens(SHARED) == {0: 0, 1: 0}


def test_running_prompts_count_as_cached_and_pins_route_readers():
    router = _router("cache_aware")
    assert router.route("first", SHARED + (1,)) == 0
    assert router.route("second", SHARED + (2,)) == 0  # its prefix is being computed on 0
    router.place_pin("pin-1", 1, SHARED, namespace="t")
    assert router.route("reader", SHARED + (3,), namespace="t") == 1  # the pin's reader
    assert router.route("stranger", SHARED + (3,)) == 0  # same tokens, other namespace
    router.release_pin("pin-1")
    assert router.replica_of_pin("pin-1") is None


def test_dead_replica_returns_its_requests_and_drops_tree_and_pins():
    router = _router("cache_aware")
    router.route("a", SHARED)
    router.place_pin("pin", 0)
    assert router.remove_replica(0) == ["a"]
    assert router.replica_ids == [1] and router.replica_of_pin("pin") is None
    assert router.route("a", SHARED) == 1  # re-run on the survivor
    router.remove_replica(1)
    with pytest.raises(NoReplicaError):
        router.route("b", SHARED)


# ---------------------------------------------------------------- counts on simulated replicas
def _support_trace(num_users: int = 16, num_turns: int = 2, seed: int = 0):
    """W1's shape in miniature: a shared prompt, then per user turns of ~40 tokens and 8-token
    replies; each turn's prompt repeats the previous turn and its reply."""
    rng = random.Random(seed)
    programs = []
    for _user in range(num_users):
        history, stages = SHARED, []
        for _ in range(num_turns):
            prompt = history + tuple(rng.randrange(5000, 9000) for _ in range(40))
            reply = tuple(rng.randrange(5000, 9000) for _ in range(8))
            stages.append([(None, prompt, reply)])
            history = prompt + reply
        programs.append(stages)
    return programs


def _lower_bound(programs) -> int:
    requests = [r for p in programs for stage in p for r in stage]
    return prefill_lower_bound([r[1] for r in requests], [(r[1], r[2]) for r in requests])


def test_cache_aware_is_within_5_percent_of_the_bound_and_round_robin_repeats_prefixes():
    programs = _support_trace()
    bound = _lower_bound(programs)
    aware = simulate(programs, 2, RouterConfig("cache_aware"), 10_000, concurrency=8)
    assert aware.num_computed_tokens <= 1.05 * bound
    rr = simulate(programs, 2, RouterConfig("round_robin"), 10_000, concurrency=8)
    # round robin computes the shared prompt once per replica, and more wherever a user's
    # next turn lands on the other replica than their first
    assert rr.num_computed_tokens >= bound + len(SHARED)
    assert min(rr.per_replica_computed) >= len(SHARED)


def test_placement_computes_less_than_request_by_request_routing_under_load():
    """Four groups of 8 users, each group with its own 400-token prefix after a short shared
    one; a tight balance guard makes request-by-request routing scatter the groups."""
    rng = random.Random(1)
    groups = [tuple(rng.randrange(10, 900) for _ in range(400)) for _ in range(4)]
    programs = [
        [[(None, (7, 7, 7) + groups[g] + (5000 + i,), (1, 2, 3))]]
        for g in range(4)
        for i in range(8)
    ]
    config = RouterConfig("cache_aware", balance_abs_threshold=2)
    routed = simulate(programs, 2, config, 10_000, concurrency=32)
    instances = [Instance(None, p[0][0][1], 3) for p in programs]
    placement = place_batch(instances, 2)
    placed = simulate(programs, 2, config, 10_000, concurrency=32, placement=placement)
    assert placed.num_computed_tokens < routed.num_computed_tokens
    assert placed.num_computed_tokens == _lower_bound(programs) + 3  # (7,7,7) on both
    assert sorted(placement.count(r) for r in range(2)) == [16, 16]


def test_placement_keeps_deepest_groups_together_and_balanced():
    deep = [Instance(None, (1,) * 50 + (g,) * 30 + (i,), 10) for g in range(4) for i in range(5)]
    random.Random(0).shuffle(deep)
    placement = place_batch(deep, 2)
    by_group: dict[int, set[int]] = {}
    for instance, replica in zip(deep, placement, strict=True):
        by_group.setdefault(instance.prefix_ids[50], set()).add(replica)
    assert all(len(replicas) == 1 for replicas in by_group.values())
    assert sorted(placement.count(r) for r in range(2)) == [10, 10]
    assert place_batch(deep[:1], 3) == [0]
    with pytest.raises(ValueError, match="num_replicas"):
        place_batch(deep, 0)


def test_without_ray_a_clear_error_names_the_extra(monkeypatch):
    """Ray absent: starting replicas says which extra to install; nothing else needs Ray."""
    import sys

    from runtime.cluster.cluster import Cluster
    from runtime.cluster.ray_support import RayNotInstalledError, require_ray
    from runtime.config import EngineConfig

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(RayNotInstalledError, match=r"pip install 'flowlang\[ray\]'"):
        require_ray()
    with pytest.raises(RayNotInstalledError, match="single-node works without it"):
        Cluster(EngineConfig(model="random:tiny", max_kv_tokens=256))
    assert simulate(_support_trace(2, 1), 2, RouterConfig(), 10_000, concurrency=2).num_requests


def test_serve_cli_puts_replicas_on_gpus_as_asked(monkeypatch):
    """`flowlang serve --device cuda --replicas 2 --gpus-per-replica 0.5`: CUDA engines, two
    replicas sharing one GPU (the CLI's configs, captured before anything starts)."""
    from flowlang.cli import main
    from runtime.cluster import serve as cluster_serve
    from runtime.cluster.cluster import ClusterConfig

    seen = {}

    def serve_cluster(config, cluster, settings, sock, extensions):
        sock.close()  # bound by the CLI before anything starts
        seen.update(locals())
        return 0  # the exit status, as after a drained SIGTERM

    monkeypatch.setattr(cluster_serve, "serve_cluster", serve_cluster)
    argv = ["serve", "--model", "random:tiny", "--device", "cuda", "--replicas", "2", "--port", "0"]
    assert main([*argv, "--gpus-per-replica", "0.5", "--routing-policy", "round_robin"]) == 0
    assert seen["config"].device == "cuda"
    assert seen["cluster"].num_replicas == 2 and seen["cluster"].num_gpus_per_replica == 0.5
    assert seen["cluster"].router.policy == "round_robin"
    with pytest.raises(ValueError, match="must be > 0"):
        ClusterConfig(num_gpus_per_replica=0)


# ---------------------------------------------------------------- program homes (issue 52)
def test_a_program_stays_home_unless_another_replica_costs_move_tokens_less():
    config = RouterConfig(min_match_tokens=32, program_move_tokens=64, balance_abs_threshold=4)

    def choose(matches, loads, evictions=(0, 0), home=0):
        return choose_cache_aware(matches, loads, evictions, 500, config, home=home)

    assert choose([40, 40], [3, 0]) == 0  # a tie goes home, not to the less loaded
    assert choose([0, 0], [3, 1]) == 0  # nothing cached anywhere: still home
    assert choose([0, 0], [3, 1], home=None) == 1  # no program: least loaded
    assert choose([40, 100], [1, 1]) == 0  # 60 tokens cheaper elsewhere: not worth a move
    assert choose([40, 120], [1, 1]) == 1  # 80 cheaper: moves
    assert choose([400, 40], [1, 1], evictions=(450, 0)) == 1  # home is full of others' KV
    assert choose([400, 40], [9, 0]) == 1  # imbalanced: the guard leaves home out


def test_router_keeps_turns_at_home_counts_moves_and_forgets_dead_homes():
    router = _router("cache_aware", min_match_tokens=32)
    turn = SHARED[:20]  # too short a match to follow: without a home, load decides
    assert router.route("p-1", turn, program="p") == 0
    assert router.route("q-1", turn, program="q") == 1  # 0 is busier
    router.finish("p-1")
    router.route("busy", (7,), prefer=0)
    assert router.route("p-2", turn + (1,), program="p") == 0  # home, though busier
    assert router.route("p-3", turn, namespace="t", program="p") == 1  # another tenant's p
    assert router.program_homes()[1] == 0
    router.remove_replica(0)
    assert router.route("p-4", turn, program="p") == 1  # its home died: no move counted
    assert router.program_homes()[1] == 0
    no_homes = _router("cache_aware", min_match_tokens=32, program_affinity=False)
    no_homes.route("busy", (7,), prefer=0)
    assert no_homes.route("p-1", turn, program="p") == 1
    no_homes.finish("busy")
    no_homes.route("busy-1", (7,), prefer=1)
    assert no_homes.route("p-2", turn, program="p") == 0  # scattered by load
    assert no_homes.program_homes()[1] == 1


def test_a_pinned_prefix_counts_as_cached_and_homes_its_readers_softly():
    """A fork's pin is its readers' home under the cost rule: they go there while it is as
    cheap as anywhere (its KV counts as cached before its events arrive), and elsewhere once
    the pin's replica costs more than `program_move_tokens` extra."""
    router = Router(RouterConfig(min_match_tokens=32, program_move_tokens=64))
    router.add_replica(0, capacity_tokens=10_000)
    router.add_replica(1, capacity_tokens=1_000)
    router.place_pin("trunk", 1, SHARED)
    assert router.match_lens(SHARED + (1,)) == {0: 0, 1: 400}
    assert router.route("branch-1", SHARED + (1,)) == 1
    router.route("hog", tuple(range(5000, 6500)), prefer=1)  # more than 1 holds
    assert router.route("branch-2", SHARED + (2,)) == 0  # evicting 500 there costs more
    router.release_pin("trunk")
    assert router.match_lens(SHARED + (3,))[1] == 400  # branch-1 still runs on 1
