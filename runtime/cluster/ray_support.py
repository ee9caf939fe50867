"""Ray, imported on demand: a clear error naming the extra when it is missing, and one place
that starts or joins a cluster (embedded `ray.init()` by default; an address, or RAY_ADDRESS,
joins an existing one)."""

from __future__ import annotations

import os
import socket
from types import ModuleType

RAY_EXTRA_HINT = "pip install 'flowlang[ray]'"
OBJECT_STORE_BYTES = 128 * 1024**2  # requests and results are small; keep Ray's store small


class RayNotInstalledError(ImportError):
    """Ray is needed for replicas but is not installed."""


def require_ray() -> ModuleType:
    """The `ray` module, or RayNotInstalledError saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise RayNotInstalledError(
            f"running replicas needs Ray, which is not installed: {RAY_EXTRA_HINT} "
            "(everything single-node works without it)"
        ) from err
    return ray


def init_ray(address: str | None = None, num_cpus: int | None = None) -> ModuleType:
    """Join `address` (or RAY_ADDRESS) if given, else start a small local Ray; idempotent."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            num_cpus=num_cpus,
            object_store_memory=OBJECT_STORE_BYTES,
            include_dashboard=False,
            log_to_driver=False,
        )
    return ray


def gcs_unreachable(ray: ModuleType, timeout_s: float) -> str | None:
    """Why Ray's control store (the GCS) did not take a connection within `timeout_s`, or
    None if it did. Ray's own driver only gives up on a lost GCS after a minute; a front that
    asks can stop serving (and say so on /health) at once. A connection, not an RPC: Ray has
    no public call with a timeout, and a dead GCS refuses connections at once."""
    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as err:  # refused, unreachable, or too slow
        return str(err) or type(err).__name__
