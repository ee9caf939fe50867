"""Backends and the process-wide default one."""

from __future__ import annotations

import threading

from flowlang.backends.base import Backend
from flowlang.backends.mock import MockBackend

_default: Backend | None = None
_lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    """Programs run on `backend` unless given another one."""
    global _default
    with _lock:
        _default = backend


def get_default_backend() -> Backend:
    """The default backend; on first use, an in-process engine on the default model."""
    global _default
    with _lock:
        if _default is None:
            from flowlang.backends.local import LocalBackend
            from runtime.engine import Engine

            _default = LocalBackend(Engine())
        return _default


__all__ = ["Backend", "MockBackend", "get_default_backend", "set_default_backend"]
