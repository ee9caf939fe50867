"""What an operator reads of a running batch: lines done / failed / running / skipped (done
before a resume), the rate and ETA, and the prefill the engine saved meanwhile (tokens read
from the cache instead of computed), for the terminal (tqdm), /metrics and the live page."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


def _no_stats() -> Mapping[str, float]:
    return {}


@dataclass
class BatchProgress:
    total: int = 0  # lines in the file, valid or not
    stats: Callable[[], Mapping[str, float]] = _no_stats  # the engine's counters
    completed: int = 0  # answered 2xx
    failed: int = 0  # a bad line, or answered with an error
    running: int = 0
    skipped: int = 0  # already in the results when the run began
    listeners: list[Callable[[BatchProgress], None]] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _counters_at_start: Mapping[str, float] = field(default_factory=dict, repr=False)

    def begin(self, total: int, skipped: int) -> None:
        self.total, self.skipped = total, skipped
        self.started_s = time.monotonic()
        self._counters_at_start = dict(self.stats())
        self._changed()

    def line_started(self) -> None:
        with self._lock:
            self.running += 1
        self._changed()

    def line_finished(self, ok: bool, ran: bool = True) -> None:
        """A line recorded: `ran` False for one that never reached a route (a bad line)."""
        with self._lock:
            self.running -= int(ran)
            if ok:
                self.completed += 1
            else:
                self.failed += 1
        self._changed()

    def line_deferred(self) -> None:
        """A started line left unrecorded, for a rerun (runner.LineDeferred)."""
        with self._lock:
            self.running -= 1
        self._changed()

    @property
    def finished(self) -> int:
        """Lines recorded by this run (not counting those skipped as done before)."""
        return self.completed + self.failed

    @property
    def remaining(self) -> int:
        return self.total - self.skipped - self.finished

    def rate_per_s(self) -> float:
        elapsed_s = time.monotonic() - self.started_s
        return self.finished / elapsed_s if elapsed_s > 0 else 0.0

    def eta_s(self) -> float | None:
        rate = self.rate_per_s()
        return self.remaining / rate if rate > 0 else None

    def prefill_tokens(self) -> dict[str, float]:
        """Tokens the engine computed, read from its cache, and loaded back from the disk tier
        since the run began (the whole engine's: on a server, other clients' requests too)."""
        now, start = self.stats(), self._counters_at_start
        return {
            name: now.get(f"{name}_total", 0.0) - start.get(f"{name}_total", 0.0)
            for name in ("prefill_tokens", "cached_tokens", "kv_loaded_disk_tokens")
        }

    def snapshot(self) -> dict[str, float | int | None]:
        tokens = self.prefill_tokens()
        return {
            "total": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "running": self.running,
            "skipped": self.skipped,
            "elapsed_s": round(time.monotonic() - self.started_s, 3),
            "rate_per_s": round(self.rate_per_s(), 3),
            "eta_s": self.eta_s(),
            "prefill_computed_tokens": tokens["prefill_tokens"],
            "prefill_saved_tokens": tokens["cached_tokens"],
            "prefill_loaded_from_disk_tokens": tokens["kv_loaded_disk_tokens"],
        }

    def _changed(self) -> None:
        for listener in self.listeners:
            listener(self)
