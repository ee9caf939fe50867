"""The live page: `GET /dashboard` (one static HTML file, no build step) polls
`GET /dashboard/data` for the engine's numbers, the top of the radix tree (drawn here, as SVG)
and the pins (behind a router front: every replica's tree, each namespace tagged), and the
running batches (lines done, failed, running, rate, ETA).

Auth is the server's: every API key works, as a Bearer header or, so that a browser can log
in, as the password of HTTP Basic auth (Guard in app.py). With API keys, a key that is not an
admin key sees its own cache namespaces, pins and batches only: nothing of another tenant's (no
namespace, salt, pin id, token or count) is sent, only the server-wide totals /metrics has.
"""

from __future__ import annotations

import asyncio
import math
import pathlib
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from runtime.cache.view import CacheView
from runtime.server.batches_api import batch_rows
from runtime.server.state import Server, ServerDep

if TYPE_CHECKING:
    from runtime.engine_api import EngineAPI

router = APIRouter()

PAGE = pathlib.Path(__file__).with_name("dashboard.html")
TREE_NODES = 30  # the tree panel's summary size
SHOWN_STATS = (  # what the page shows (the same names as in /metrics, prefixed flowlang_)
    "num_running",
    "num_waiting",
    "num_pins",
    "requests_finished_total",
    "prefill_tokens_total",
    "cached_tokens_total",
    "decode_tokens_total",
    "cache_hit_rate",
    "evicted_tokens_total",
    "kv_slots_used",
    "kv_slots_total",
    "cache_tokens",
    "forward_passes_total",
    "spec_accepted_tokens_total",
    "spec_mean_accepted_length",
)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard_page() -> HTMLResponse:
    """The page itself: HTML, CSS and a script, all in one file."""
    return HTMLResponse(PAGE.read_text(encoding="utf-8"), headers={"Cache-Control": "no-store"})


@router.get("/dashboard/data")
async def dashboard_data(request: Request, server: ServerDep) -> dict:
    """One sample: the engine's stats, the tree (SVG and totals) and the pins."""
    stats = await asyncio.to_thread(server.engine.stats)
    view = await request.app.state.tree_views.get(server.engine, stats)
    tree = _tree(_for_caller(view, request, server))
    everyone = not server.keys or server.is_admin(request)
    return {
        "time_s": time.time(),
        "uptime_s": time.time() - server.started,
        "stats": {name: stats[name] for name in SHOWN_STATS if name in stats},
        "tree": tree,
        "batches": await batch_rows(request.app, None if everyone else server.tenant(request)),
    }


class TreeViews:
    """The tree view the pages share. A view walks the whole tree on the engine's loop thread,
    so while requests run it is rebuilt at most once per `busy_interval_s`, however many pages
    are open; an idle engine's view is rebuilt whenever the tree may have changed."""

    def __init__(self, busy_interval_s: float = 1.0) -> None:
        self.busy_interval_s = busy_interval_s
        self._lock = asyncio.Lock()
        self._view: CacheView | None = None
        self._key: tuple | None = None
        self._built_at = -math.inf

    async def get(self, engine: EngineAPI, stats: dict) -> CacheView:
        key = tuple(stats.get(name) for name in _TREE_CHANGES)
        busy = stats.get("num_running", 0) or stats.get("num_waiting", 0)
        async with self._lock:
            fresh = time.monotonic() - self._built_at < self.busy_interval_s
            if self._view is None or (key != self._key and not (busy and fresh)):
                self._view = await asyncio.to_thread(engine.cache_view, TREE_NODES)
                self._key, self._built_at = key, time.monotonic()
            return self._view


# the tree changes only with these (a step, an eviction, a flush, a pin)
_TREE_CHANGES = ("steps_total", "cache_tokens", "cache_nodes", "num_pins", "evicted_tokens_total")


def _for_caller(view: CacheView, request: Request, server: Server) -> CacheView:
    """Without keys, or for an admin key, everything; else only the caller's own namespaces
    and the pins in them (the server-wide totals stay: /metrics shows them to every key)."""
    if not server.keys or server.is_admin(request):
        return view
    tenant = server.tenant(request)

    def owned(namespace: str) -> bool:
        """Whether a namespace's repr is the tenant's tag, or the tag + "/" + a salt."""
        quote, text = namespace[:1], namespace[1:]
        return quote in ("'", '"') and (text == tenant + quote or text.startswith(tenant + "/"))

    return replace(
        view,
        namespaces=tuple(ns for ns in view.namespaces if owned(ns.namespace)),
        pins=tuple(pin for pin in view.pins if owned(pin.namespace)),
    )


def _tree(view: CacheView) -> dict:
    return {
        "svg": view.to_svg(),
        "total_tokens": view.total_tokens,
        "evictable_tokens": view.evictable_tokens,
        "protected_tokens": view.protected_tokens,
        "num_nodes": view.num_nodes,
        "capacity_tokens": view.capacity_tokens,
        "policy": view.policy,
        "pins": [asdict(pin) for pin in view.pins],
    }
