"""`flowlang serve --replicas N`: the same HTTP API in front of a router over N replicas."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from runtime.cluster.cluster import GCS_LOST_GRACE_S, Cluster, ClusterConfig
from runtime.cluster.front import ClusterEngine
from runtime.config import EngineConfig
from runtime.server.extensions import AppExtension
from runtime.server.state import ServerSettings


def serve_cluster(
    engine_config: EngineConfig,
    cluster_config: ClusterConfig,
    settings: ServerSettings,
    sock: socket.socket | None = None,
    extensions: Sequence[AppExtension] = (),
) -> int:
    """Start (or join) Ray, start the replicas, serve until SIGTERM or SIGINT, drain, then stop
    them; return the exit status. If Ray's control store is lost, the server drains (within
    GCS_LOST_GRACE_S, before Ray ends this driver) and the status is 70, so that a supervisor
    starts it again. `sock`: the listening socket, bound before the replicas start (bound here
    if not given)."""
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
        return run_app(
            front,
            settings,
            sock,
            fatal=lambda: front.cluster.control_lost,
            fatal_grace_s=GCS_LOST_GRACE_S,
            extensions=extensions,
        )
    finally:
        front.close()
