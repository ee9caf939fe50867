"""`flowlang serve --replicas N`: the same HTTP API in front of a router over N replicas."""

from __future__ import annotations

from runtime.cluster.cluster import Cluster, ClusterConfig
from runtime.cluster.front import ClusterEngine
from runtime.config import EngineConfig
from runtime.server.state import ServerSettings


def serve_cluster(
    engine_config: EngineConfig, cluster_config: ClusterConfig, settings: ServerSettings
) -> None:
    """Start (or join) Ray, start the replicas, serve until interrupted, then stop them."""
    from runtime.server.app import run_app

    front = ClusterEngine(Cluster(engine_config, cluster_config))
    try:
        run_app(front, settings)
    finally:
        front.close()
