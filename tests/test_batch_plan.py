"""run_batch by plan: every instance compiled once whatever the backend's placement, each group
run on its own backend with its own shared-prefix pins, results and failures in batch order;
ClusterBackend's plan from a stand-in cluster (no Ray: test_cluster_ray.py runs the real one)."""

from __future__ import annotations

import importlib
from collections import Counter
from types import SimpleNamespace

import pytest

from flowlang import gen, program
from flowlang.backends.base import BatchInstance, BatchPlan, PlacedGroup
from flowlang.backends.cluster import ClusterBackend
from flowlang.backends.mock import MockBackend
from flowlang.errors import InstanceError

# the module, not the `program` decorator that flowlang's package namespace exports by that name
PROGRAM_MODULE = importlib.import_module("flowlang.program")
PREAMBLE = "A shared preamble of some length " * 10


@program
def one(s, topic):
    s += PREAMBLE + topic
    s += gen("x", max_new_tokens=2)


class Halves(MockBackend):
    """Places even instances on one mock and odd ones on another: a cluster's replicas in small."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.replicas = (MockBackend(), MockBackend())
        self.seen: list[BatchInstance] = []

    def plan_batch(self, instances, namespace):
        self.seen = list(instances)
        return BatchPlan(
            tuple(
                PlacedGroup(replica, tuple(range(k, len(instances), 2)))
                for k, replica in enumerate(self.replicas)
            )
        )


@pytest.fixture
def compiles(monkeypatch):
    """How often each instance (by its arguments) is traced."""
    counts: Counter = Counter()
    traced = PROGRAM_MODULE.trace

    def counted(name, fn, backend, args, kwargs, state_type):
        counts[tuple(sorted(kwargs.items()))] += 1
        return traced(name, fn, backend, args, kwargs, state_type)

    monkeypatch.setattr(PROGRAM_MODULE, "trace", counted)
    return counts


def _keys(batch):
    return Counter(tuple(sorted(args.items())) for args in batch)


def test_each_instance_is_compiled_once_on_a_plain_backend(compiles):
    batch = [{"topic": t} for t in ("a", "b", "c")]
    states = one.run_batch(batch, backend=MockBackend(), progress=False)
    assert [s["x"] for s in states]
    assert compiles == _keys(batch)


def test_a_placed_batch_is_compiled_once_and_runs_group_by_group(compiles):
    backend = Halves()
    backend.replicas[1].fail_on = "boom"
    batch = [{"topic": t} for t in ("a", "b", "c", "boom", "e")]
    results = one.run_batch(batch, backend=backend, progress=False)
    assert compiles == _keys(batch)  # placing took no second compile
    assert all(i.prefix_ids and i.num_extra_tokens == 0 for i in backend.seen)
    assert isinstance(results[3], InstanceError) and results[3].index == 3
    for index in (0, 1, 2, 4):
        assert results[index].text().startswith(PREAMBLE + batch[index]["topic"])
    assert not backend.requests and not backend.pins  # everything ran on the replicas
    for replica in backend.replicas:
        (pin,) = replica.pins  # its group's shared preamble, prefilled once there
        assert pin.released
        assert replica.decode(pin.prefix_ids).startswith(PREAMBLE.rstrip())


def _cluster_backend(place: bool = True) -> ClusterBackend:
    config = SimpleNamespace(tool_call_parser="hermes", reasoning_parser="none")
    cluster = SimpleNamespace(engine_config=config, router=SimpleNamespace(replica_ids=[3, 7]))
    tokenizer = SimpleNamespace(chat_template=None, bos_token="", eos_token="")
    return ClusterBackend(cluster, tokenizer, place=place)


def test_cluster_plan_puts_each_shared_prefix_on_one_replica():
    a, b = (1,) * 40, (2,) * 40
    instances = [BatchInstance(p + (i,)) for i, p in enumerate((a, b, a, b))]
    plan = _cluster_backend().plan_batch(instances, None)
    placed = {group.backend.replica: group.indices for group in plan.groups}
    assert sorted(placed.values()) == [(0, 2), (1, 3)]
    assert set(placed) == {3, 7}


def test_an_unplaced_cluster_keeps_the_batch_whole():
    backend = _cluster_backend(place=False)
    instances = [BatchInstance((1, 2, 3)), BatchInstance((4, 5))]
    (group,) = backend.plan_batch(instances, None).groups
    assert group.backend is backend and group.indices == (0, 1)
    assert backend.on_replica(3).plan_batch(instances, None).groups[0].indices == (0, 1)
    assert backend.place_batch(one, [{"topic": "a"}], {}) is None
