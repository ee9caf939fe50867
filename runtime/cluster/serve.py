"""`flowlang serve --replicas N`: the same HTTP API in front of a router over N replicas."""

from __future__ import annotations

import socket

from runtime.cluster.cluster import Cluster, ClusterConfig
from runtime.cluster.front import ClusterEngine
from runtime.config import EngineConfig
from runtime.server.state import ServerSettings


def serve_cluster(
    engine_config: EngineConfig,
    cluster_config: ClusterConfig,
    settings: ServerSettings,
    sock: socket.socket | None = None,
) -> None:
    """Start (or join) Ray, start the replicas, serve until interrupted, then stop them.
    `sock`: the listening socket, bound before the replicas start (bound here if not given)."""
    from runtime.server.app import run_app
    from runtime.server.listen import bind_socket

    if sock is None:
        sock = bind_socket(settings.host, settings.port)
    try:
        front = ClusterEngine(Cluster(engine_config, cluster_config))
    except BaseException:
        sock.close()
        raise
    try:
        run_app(front, settings, sock)
    finally:
        front.close()
