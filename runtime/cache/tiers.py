"""KV below the device pool: host memory (L2) and a directory of chunk files (L3).

The radix tree holds the device tier (L1). What it evicts is demoted here instead of thrown
away, and a request whose path continues past its device match loads those tokens into fresh
slots instead of computing them. The unit is a *chunk*: `chunk_tokens` tokens (whole pages)
at a fixed offset from the root, named by a digest chained over every token from the root,
starting from the layout's fingerprint (model, weights, dtype, page size, KV shape) and the
namespace. So a name stands for its whole prefix: a namespace never reads another's chunks,
and a file written for another model or dtype has a name nobody asks for (and a header that
says so). A chunk may live in L2, L3 or both; the tree's nodes stay device-only, and "how far
the lower tiers extend a device match" is a walk along the request's own chunk names.

Threads: the engine's loop thread demotes, probes and loads; a writer thread writes L3 files
(write-back from L2, or write-through); a prefetch thread reads L3 files ahead of admission, into
L2 or, with no L2, into a small staging area (staging.py). The loop thread never reads a file:
admission waits for a reader's files (`ready`), at most `DISK_WAIT_S`, and what is not read by
then is computed. `lock` guards the indexes and host rows; file I/O happens outside it, but for a
write the writer thread is too far behind to take (the caller writes it rather than lose it).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path

import torch

from runtime.cache.chunks import TierLayout, TierView, chunk_names, root_name, tail_name
from runtime.cache.disk_tier import DiskTier, NoDiskTier
from runtime.cache.host_tier import HostTier, NoHostTier
from runtime.cache.lower import TierCounters, TierExtent
from runtime.cache.pool import KVPool
from runtime.cache.staging import StagingArea
from runtime.prefix import common_prefix_len

log = logging.getLogger("flowlang.kv_tiers")

WRITE_QUEUE_CHUNKS = 256  # L3 writes waiting at most; beyond, the caller writes (counted)


class KVTiers:
    """L2 and/or L3 under one KV pool: demote, probe, load, prefetch, persist (the
    `LowerTiers` protocol, lower.py). A tier not configured is a null object (NoHostTier,
    NoDiskTier) that holds nothing."""

    keeps_evicted = True

    def __init__(
        self,
        pool: KVPool,
        layout: TierLayout,
        host_bytes: int = 0,
        disk_dir: str | Path | None = None,
        disk_bytes: int = 0,
        write_policy: str = "write_back",
        event_sink: Callable[..., None] = lambda *event: None,
    ) -> None:
        self.pool = pool
        self.layout = layout
        self.chunk_tokens = layout.chunk_tokens
        self.fingerprint = layout.fingerprint
        self.write_policy = write_policy  # config.KV_WRITE_POLICIES
        host_chunks = host_bytes // layout.chunk_nbytes
        if not host_chunks and disk_dir is None:
            raise ValueError("KVTiers needs host memory (host_bytes) or a disk directory")
        self.host = (
            HostTier(layout, host_chunks, pool.device.type == "cuda")
            if host_chunks
            else NoHostTier()
        )
        self.disk = (
            DiskTier(disk_dir, layout, disk_bytes, lambda k, n: self._note(k, "disk", n))
            if disk_dir is not None
            else NoDiskTier()
        )
        self.counters = TierCounters()
        self.lock = threading.Lock()
        self._pending: dict[bytes, torch.Tensor] = {}  # queued L3 writes, readable meanwhile
        # partial last chunks of evicted paths (L2 only): previous chunk's name -> {tokens:
        # tail name}, and back; so a page-1 path loses nothing at its end
        self._tails: dict[bytes, dict[tuple[int, ...], bytes]] = {}
        self._tail_of: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}
        self._writes: queue.Queue = queue.Queue(WRITE_QUEUE_CHUNKS)
        self._prefetches: queue.Queue = queue.Queue()
        self._prefetching: set[bytes] = set()
        self._staged = StagingArea(layout.chunk_nbytes)  # read for admission (`ready`)
        # KV events (events.py: the publisher's emit): changes made on any thread wait in
        # _events until the loop thread flushes them (once a step)
        self.event_sink = event_sink
        self._events: list[tuple[str, str, bytes]] = []
        self._events_lock = threading.Lock()
        self._threads = []
        if self.disk.exists:
            for target, name in (
                (self._write_loop, "kv-disk-writer"),
                (self._prefetch_loop, "kv-prefetch"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)

    # ------------------------------------------------------------------ probe
    def names(
        self, namespace: Hashable, ids: Sequence[int], end: int, memo: list[bytes] | None = None
    ) -> list[bytes]:
        return chunk_names(
            self.fingerprint, namespace, ids, self.chunk_tokens, end // self.chunk_tokens, memo
        )

    def extent(
        self,
        namespace: Hashable,
        ids: Sequence[int],
        start: int,
        limit: int,
        memo: list[bytes] | None = None,
    ) -> TierExtent:
        """How far L2/L3 continue `ids` past a device match ending at `start` (pure)."""
        c = self.chunk_tokens
        first = start // c
        names = self.names(namespace, ids, limit, memo)
        found, in_host = [], []
        with self.lock:
            for name in names[first:]:
                here = name in self.host
                if not (here or self._on_disk(name)):
                    break
                found.append(name)
                in_host.append(here)
            tail, tail_tokens = self._tail_after(namespace, ids, names, first + len(found), limit)
        extent = TierExtent(start, first, tuple(found), tuple(in_host), c, tail, tail_tokens)
        return extent if extent.end > start else TierExtent(start, first, (), (), c)

    def _tail_after(
        self, namespace: Hashable, ids: Sequence[int], names: list[bytes], k: int, limit: int
    ) -> tuple[bytes | None, int]:
        """The partial chunk held for chunk `k` that shares most of `ids` up to `limit`, and
        how many tokens (whole pages) of it do: any head of a chunk's KV is valid for every
        sequence that shares the head."""
        prev = names[k - 1] if k else root_name(self.fingerprint, namespace)
        base = k * self.chunk_tokens
        window = tuple(ids[base : min(limit, base + self.chunk_tokens)])
        best, best_len = None, 0
        for tokens, name in self._tails.get(prev, {}).items():
            shared = common_prefix_len(tokens, window)
            shared -= shared % self.layout.page_size
            if shared > best_len:
                best, best_len = name, shared
        return best, best_len

    # ------------------------------------------------------------------ down
    def demote(
        self, namespace: Hashable, path: tuple[int, ...], start: int, slots: torch.Tensor
    ) -> None:
        """Keep the whole chunks of `path` from `start` on (`slots`: the whole path's, still
        valid) below L1: in L2 if there is one, else in L3. Never raises: it runs inside the
        tree's eviction, which must complete."""
        try:
            self._store(namespace, path, start, slots, count=True)
        except Exception:  # noqa: BLE001 - see _failed
            self._failed("keeping evicted KV below the pool")

    def store(
        self,
        namespace: Hashable,
        ids: Sequence[int],
        start: int,
        slots: torch.Tensor,
        memo: list[bytes] | None = None,
    ) -> None:
        """Write-through: back up the whole chunks of `ids` from `start` on, now (`memo`: the
        sequence's chunk names so far, see chunk_names)."""
        self._store(namespace, ids, start, slots, count=False, to_disk=True, memo=memo)

    def _store(
        self, namespace, ids, start, slots, count: bool, to_disk: bool = False, memo=None
    ) -> None:
        c = self.chunk_tokens
        names = self.names(namespace, ids, len(ids), memo)
        first = start // c
        with self.lock:
            new = []  # (chunk, into L2, into L3)
            for k in range(first, len(names)):
                name = names[k]
                into_host = self.host.takes(name)
                into_disk = (
                    self.disk.exists
                    and (not self.host.capacity_chunks or to_disk)
                    and not self._on_disk(name)
                )
                if into_host or into_disk:
                    new.append((k, into_host, into_disk))
            for k, into_host, into_disk in new:
                chunk_slots = slots[k * c : (k + 1) * c]
                if into_host:  # gathered straight into its row
                    row = self._take_row(names[k])
                    self.pool.read_rows_into(chunk_slots, *self.host.data[row].unbind(0))
                    data = self.host.data[row].clone() if into_disk else None
                else:
                    data = torch.stack(self.pool.read_rows(chunk_slots)).cpu()
                if into_disk:  # its own (2, layers, c, heads, dim) copy, for the writer
                    self._queue_write(names[k], data)
            if count and self.host.capacity_chunks and len(ids) % c:
                self._store_tail(namespace, ids, names, slots)
            self.host.touch(names[first:])
        if count:
            self.counters.demoted_tokens += len(new) * c

    def _store_tail(self, namespace, ids, names: list[bytes], slots: torch.Tensor) -> None:
        """Keep the path's last, partial chunk in L2 (an evicted conversation's last turn
        rarely ends on a chunk boundary)."""
        c = self.chunk_tokens
        k = len(ids) // c
        prev = names[k - 1] if k else root_name(self.fingerprint, namespace)
        tokens = tuple(ids[k * c :])
        if any(held[: len(tokens)] == tokens for held in self._tails.get(prev, {})):
            return  # held already, maybe within a longer one (leaf-first: a child's went first)
        name = tail_name(prev, tokens)
        self._tails.setdefault(prev, {})[tokens] = name
        self._tail_of[name] = (prev, tokens)
        row = self._take_row(name)
        k_rows, v_rows = self.host.data[row, :, :, : len(tokens)].unbind(0)
        self.pool.read_rows_into(slots[k * c : len(ids)], k_rows, v_rows)
        self.counters.demoted_tokens += len(tokens)

    def _spill(self, name: bytes, row: int) -> None:
        """An L2 row is reused: its chunk goes to L3 unless it is there (write-back); a
        partial chunk is only forgotten."""
        if name in self._tail_of:
            prev, tokens = self._tail_of.pop(name)
            del self._tails[prev][tokens]
            if not self._tails[prev]:
                del self._tails[prev]
            return
        if self.disk.writable and not self._on_disk(name):
            self._queue_write(name, self.host.data[row].clone())

    def _on_disk(self, name: bytes) -> bool:
        """In L3, or queued for it (a queued chunk is read from memory meanwhile)."""
        return name in self._pending or self.disk.contains(name)

    def _queue_write(self, name: bytes, data: torch.Tensor) -> None:
        if not self.disk.writable or name in self._pending:
            return
        try:
            self._writes.put_nowait(name)
        except queue.Full:  # the writer is behind: write here rather than lose the chunk
            self.counters.writes_inline += 1
            self.disk.write(name, data)
            return
        self._pending[name] = data

    def persist(self, paths: Iterable[tuple[Hashable, Sequence[int], torch.Tensor]]) -> int:
        """Write every whole chunk of the given (namespace, path, slots) and every L2 chunk
        that is not on disk yet, here and now (a clean shutdown: a restart on the same
        directory starts warm; the write queue would drop what does not fit), at most what
        the disk tier holds (more would only push out what was just written). Returns how
        many chunks were written."""
        self.drain()
        c, written = self.chunk_tokens, 0
        room = self.disk.capacity_bytes // self.disk.file_nbytes
        for namespace, path, slots in paths:
            for k, name in enumerate(self.names(namespace, path, len(path))):
                if written >= room:
                    return written
                if self.disk.writable and not self.disk.contains(name):
                    k_rows, v_rows = self.pool.read_rows(slots[k * c : (k + 1) * c])
                    written += self.disk.write(name, torch.stack([k_rows, v_rows]).cpu())
        with self.lock:
            rows = [(n, row) for n, row in self.host.items() if n not in self._tail_of]
        for name, row in rows:
            if written < room and self.disk.writable and not self.disk.contains(name):
                with self.lock:
                    data = self.host.data[row].clone()
                written += self.disk.write(name, data)
        return written

    # ------------------------------------------------------------------ up
    def load(self, extent: TierExtent, slots: torch.Tensor) -> int:
        """Copy the extent into `slots` ((extent.num_tokens,) fresh slots); returns how many
        tokens were loaded: fewer if an L3 chunk turned out bad (the rest is computed)."""
        try:
            return self._load(extent, slots)
        except Exception:  # noqa: BLE001 - see _failed: the caller computes them instead
            self._failed("loading KV from below the pool")
            return 0

    def _load(self, extent: TierExtent, slots: torch.Tensor) -> int:
        """Chunk by chunk, straight from a host row (under the lock, so it is not reused
        meanwhile), a queued write or a staged read into the pool: one copy per chunk. Files
        are read on the prefetch thread only (`ready`): a chunk not read by now is computed."""
        started = time.perf_counter()
        c = self.chunk_tokens
        items = [(name, c) for name in extent.names]
        if extent.tail is not None:
            items.append((extent.tail, extent.tail_tokens))
        loaded = from_host = 0
        read = []
        for k, (name, size) in enumerate(items):
            skip = max(0, extent.start - (extent.first_chunk + k) * c)  # the device has those
            target = slots[loaded : loaded + size - skip]
            with self.lock:
                row = self.host.row(name)
                if row is not None:
                    chunk = self.host.data[row]  # (2, layers, c, heads, dim)
                    self.pool.write_rows(target, chunk[0, :, skip:size], chunk[1, :, skip:size])
                    from_host += size - skip
                else:
                    chunk = self._pending.get(name)
                    if chunk is None:
                        chunk = self._staged.take(name)
            if row is None:
                if chunk is None:
                    break  # a bad or unread file, a partial chunk pushed out: computed
                self.pool.write_rows(target, chunk[0, :, skip:size], chunk[1, :, skip:size])
            loaded += size - skip
            read.append(name)
        if read:
            with self.lock:
                self.host.touch(read)
        self.counters.loaded_host_tokens += from_host
        self.counters.loaded_disk_tokens += loaded - from_host
        self.counters.load_seconds += time.perf_counter() - started
        return loaded

    @property
    def hold_budget_chunks(self) -> int:
        """How many chunks may be held (L2) or staged (no L2) for known readers at once."""
        if self.host.capacity_chunks:
            return self.host.capacity_chunks // 2
        return self._staged.capacity_chunks  # (no L2: there is a disk)

    def prefetch(self, extent: TierExtent, budget_chunks: int) -> int:
        """Keep the first `budget_chunks` chunks of the extent in host memory for a known
        reader: hold those already in L2, read the L3-only ones on the prefetch thread
        (into L2, else the staging area; never waits). Returns the chunks of the budget used."""
        names = extent.names[:budget_chunks]
        with self.lock:
            for name, here in zip(names, extent.in_host, strict=False):
                if here:
                    self.host.hold(name)
        unread = [n for n, here in zip(names, extent.in_host, strict=False) if not here]
        self._read_ahead(unread, into_host=bool(self.host.capacity_chunks))
        return len(names)

    def ready(self, extent: TierExtent) -> bool:
        """Admission's question: can the extent be loaded without reading a file on this
        thread (its chunks in L2, a queued write or the staging area)? If not, the missing
        ones are queued for the prefetch thread into the staging area (never waits); what
        the area cannot take is computed. (Without a disk every chunk of an extent is in L2.)"""
        with self.lock:
            unread = [
                name
                for name in extent.names
                if name not in self.host and name not in self._staged and name not in self._pending
            ]
            del unread[self._staged.capacity_chunks :]
        self._read_ahead(unread, into_host=False)
        return not unread

    def _read_ahead(self, names: Iterable[bytes], into_host: bool) -> None:
        """Queue L3-only chunks for the prefetch thread, each once at a time; for the staging
        area only while it has room (what is staged for the first readers is never pushed
        out by reads for later ones). Without a disk there is nothing to read, and no thread."""
        if not self.disk.exists:
            return
        for name in names:
            if name in self._prefetching:
                continue
            if not into_host:
                with self.lock:
                    if not self._staged.has_room:
                        return
                    self._staged.num_reading += 1
            self._prefetching.add(name)
            self._prefetches.put((name, into_host))

    def _put_host(self, name: bytes, data: torch.Tensor) -> None:
        """Copy a chunk (2, layers, c, heads, dim) into an L2 row, unless it is there."""
        if name not in self.host:
            self.host.data[self._take_row(name)].copy_(data)

    def _take_row(self, name: bytes) -> int:
        """An L2 row for `name` (not there yet), its previous chunk spilled to L3 first."""
        row, displaced = self.host.take(name)
        if displaced is not None:
            if displaced[0] not in self._tail_of:  # partial chunks have no events
                self._note("removed", "host", displaced[0])
            self._spill(*displaced)
        if name not in self._tail_of:
            self._note("stored", "host", name)
        return row

    # ------------------------------------------------------------------ events
    def _note(self, kind: str, medium: str, name: bytes) -> None:
        with self._events_lock:
            self._events.append((kind, medium, name))

    def flush_events(self) -> None:
        """Publish the lower tiers' changes since the last flush (loop thread), runs of one
        kind and medium as one event."""
        if not self._events:
            return
        with self._events_lock:
            events, self._events = self._events, []
        for (kind, medium), run in itertools.groupby(events, key=lambda e: e[:2]):
            self.event_sink(kind, None, (), 0, medium, tuple(e[2].hex() for e in run))

    def lower_snapshot(self) -> list[tuple[str, tuple[str, ...]]]:
        """(medium, hex chunk names) per tier, for a new subscriber's snapshot (loop thread);
        changes not yet flushed are in it already."""
        with self.lock, self._events_lock:
            self._events.clear()
            host = [n for n, _ in self.host.items() if n not in self._tail_of]  # (tails: none)
            disk = self.disk.names()
        return [("host", tuple(n.hex() for n in host)), ("disk", tuple(n.hex() for n in disk))]

    # ------------------------------------------------------------------ threads
    def _write_loop(self) -> None:
        while (name := self._writes.get()) is not None:
            try:
                with self.lock:
                    data = self._pending.get(name)
                if data is not None:
                    self.disk.write(name, data)
            except Exception:  # noqa: BLE001 - a bug here must not stop the writer (or drain)
                self._failed("writing a KV chunk to disk")
            finally:
                with self.lock:
                    self._pending.pop(name, None)
                self._writes.task_done()

    def _prefetch_loop(self) -> None:
        while (item := self._prefetches.get()) is not None:
            name, into_host = item
            try:
                self._prefetch_one(name, into_host)
            except Exception:  # noqa: BLE001 - a bug here must not stop prefetching (or drain)
                self._failed("prefetching a KV chunk")
            finally:
                if not into_host:
                    with self.lock:
                        self._staged.num_reading -= 1
                self._prefetching.discard(name)
                self._prefetches.task_done()

    def _prefetch_one(self, name: bytes, into_host: bool) -> None:
        started = time.perf_counter()
        with self.lock:
            known = name in self.host if into_host else name in self._staged
            if known and into_host:
                self.host.hold(name)
        data = None if known else self.disk.read(name)
        if data is None:
            return  # known already, or a bad file (DiskTier forgets it: the extent ends there)
        with self.lock:
            if into_host:
                self._put_host(name, data)
                self.host.hold(name)
            else:
                self._staged.put(name, data)
            self.counters.prefetched_chunks += 1
            self.counters.prefetch_seconds += time.perf_counter() - started

    def _failed(self, what: str) -> None:
        """An unexpected error below the pool: the KV involved is computed again instead
        (results do not change); counted, the first one logged with its traceback."""
        self.counters.errors += 1
        if self.counters.errors == 1:
            log.exception("%s failed; its tokens will be computed instead", what)

    def drain(self) -> None:
        """Wait for queued prefetches and writes (tests, shutdown; at once without a disk)."""
        self._prefetches.join()
        self._writes.join()

    def close(self) -> None:
        """Finish queued writes, stop the threads."""
        self.drain()
        for q in (self._writes, self._prefetches):
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    def view(self) -> TierView:
        """How these tiers name chunks and where their disk is, for a router."""
        return TierView(self.disk.root, self.fingerprint, self.chunk_tokens)

    # ------------------------------------------------------------------ stats, checks
    def describe(self) -> str:
        """One line for the engine's startup summary."""
        parts = []
        if self.host.capacity_chunks:
            gib = self.host.capacity_chunks * self.layout.chunk_nbytes / 2**30
            parts.append(
                f"host {gib:.2f} GiB ({self.host.capacity_chunks * self.chunk_tokens:,} tokens)"
            )
        if self.disk.exists:
            found = len(self.disk) * self.chunk_tokens
            state = "" if self.disk.writable else ", read only (see the warning)"
            parts.append(
                f"disk {self.disk.root} (up to {self.disk.capacity_bytes / 2**30:g} "
                f"GiB, {found:,} tokens there at start{state})"
            )
        policy = self.write_policy.replace("_", "-")
        return f"{'; '.join(parts)}; {policy}, {self.chunk_tokens}-token chunks"

    def _host_tokens(self) -> int:
        short = sum(self.chunk_tokens - len(tokens) for _, tokens in self._tail_of.values())
        return len(self.host) * self.chunk_tokens - short

    def stats(self) -> dict[str, float]:
        c = self.counters
        return {
            "kv_demoted_tokens_total": c.demoted_tokens,
            "kv_loaded_host_tokens_total": c.loaded_host_tokens,
            "kv_loaded_disk_tokens_total": c.loaded_disk_tokens,
            "kv_prefetched_tokens_total": c.prefetched_chunks * self.chunk_tokens,
            "kv_load_seconds_total": c.load_seconds,
            "kv_prefetch_seconds_total": c.prefetch_seconds,
            "kv_host_held_tokens": self.host.num_held * self.chunk_tokens,
            "kv_host_tokens": self._host_tokens(),
            "kv_host_capacity_tokens": self.host.capacity_chunks * self.chunk_tokens,
            "kv_disk_tokens": len(self.disk) * self.chunk_tokens,
            "kv_disk_bad_files_total": self.disk.num_bad_files,
            "kv_disk_writes_total": self.disk.num_writes,
            "kv_disk_write_errors_total": self.disk.num_write_errors,
            "kv_disk_writes_inline_total": c.writes_inline,
            "kv_tier_errors_total": c.errors,
            "kv_disk_writable": int(self.disk.writable),
        }

    def check_integrity(self) -> None:
        with self.lock:
            self._staged.check_integrity()
            self.host.check_integrity()
            indexed = {name for tails in self._tails.values() for name in tails.values()}
            assert indexed == set(self._tail_of), "the partial-chunk index drifted"
            for name, (prev, tokens) in self._tail_of.items():
                assert name in self.host, "a partial chunk left L2 but not its index"
                assert self._tails[prev][tokens] == name and 0 < len(tokens) < self.chunk_tokens
