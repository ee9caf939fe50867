"""Replicas on a Ray cluster of two nodes, joined by address (`--ray-address`): a head and a
worker started with `ray start` on this machine, one CPU each, so each replica lands on its own
node. Programs run on them give one engine's greedy outputs; the trees follow the events."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray

import flowlang as fl
from flowlang.backends.cluster import ClusterBackend
from flowlang.backends.local import LocalBackend
from programs import support_agent
from runtime.cluster.cluster import Cluster, ClusterConfig
from runtime.config import EngineConfig
from runtime.engine import Engine

RAY = str(Path(sys.executable).with_name("ray"))
NODE_FLAGS = [
    "--node-ip-address=127.0.0.1",
    "--num-cpus=1",
    "--object-store-memory=200000000",
    "--disable-usage-stats",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and a worker node (`ray start`), stopped afterwards, with Ray 2.60's token
    authentication on every node and this driver (RAY_AUTH_MODE=token, set for the driver by
    conftest before Ray is imported; the token in ~/.ray/auth_token, made if missing), as on a
    real cluster. A local `ray.init()` earlier in this process uses the same token."""
    if ray.is_initialized():
        ray.shutdown()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"
    generate = [RAY, "get-auth-token", "--generate"]
    subprocess.run(generate, env=env, check=True, capture_output=True, timeout=60)
    address = f"127.0.0.1:{free_port()}"
    head = [RAY, "start", "--head", f"--port={address.split(':')[1]}", "--include-dashboard=false"]
    try:
        subprocess.run([*head, *NODE_FLAGS], env=env, check=True, capture_output=True, timeout=180)
        worker = [RAY, "start", f"--address={address}", *NODE_FLAGS]
        subprocess.run(worker, env=env, check=True, capture_output=True, timeout=180)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=180)


def test_replicas_on_two_nodes_joined_by_address_run_programs_as_one_engine(
    two_nodes, tiny_model_dir
):
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=16_384)
    with Engine(config) as single:
        inputs = support_agent.make_inputs(single.tokenizer, "test")
        batch = support_agent.batch_args(inputs)[:4]
        expected = support_agent.support_agent.run_batch(
            batch, backend=LocalBackend(single), progress=False
        )
        tokenizer = single.tokenizer
    with Cluster(config, ClusterConfig(num_replicas=2, ray_address=two_nodes)) as cluster:
        assert len({node["NodeID"] for node in ray.nodes() if node["Alive"]}) == 2
        nodes = [
            p["node_id"] for p in ray.get([a.placement.remote() for a in cluster.actors.values()])
        ]
        assert len(set(nodes)) == 2, "each replica on its own node"
        placed = support_agent.support_agent.run_batch(
            batch, backend=ClusterBackend(cluster, tokenizer), progress=False
        )
        assert all(isinstance(s, fl.ProgramState) for s in placed), placed
        assert [s.variables() for s in placed] == [s.variables() for s in expected]
        cluster.wait_for_events()
        for replica_id in cluster.router.replica_ids:
            truth = ray.get(cluster.actors[replica_id].peek_snapshot.remote())
            assert cluster.router.tree(replica_id).num_tokens == sum(
                len(e.token_ids) - e.start_len for e in truth.stored
            )
        cluster.check_integrity()
