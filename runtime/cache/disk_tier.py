"""The disk tier (L3) below host memory: a directory of KV chunk files.

A file is one chunk, named by its chunk name (chunks.py), in a directory per layout
fingerprint: a header (magic, fingerprint, chunk name, payload size, a keyed MAC of all that
and the payload) and the chunk's K and V. Written whole under a temporary name and renamed, so
a crash never leaves a file a later run trusts; anything that does not check out is a miss,
read boundedly and verified first (disk_files.py: what the tier trusts of its directory).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.cache.chunks import NAME_BYTES, TierLayout, chunk_file
from runtime.cache.disk_files import (
    MAC_BYTES,
    UntrustedFile,
    check_directory,
    chunk_mac,
    deployment_key,
    macs_equal,
    read_bounded,
    write_exclusive,
)

log = logging.getLogger("flowlang.kv_tiers")

_MAGIC = b"FLKVCHK3"  # 3: a keyed MAC (2: crc32); (K|V, layers, tokens, heads, dim) chunks
# write errors that would recur: writing stops (others, such as a temporary file another
# engine sharing the directory removed, lose that one chunk)
_LASTING_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO}
_FIELDS = struct.Struct("<8s16s16sQ")  # magic, layout fingerprint, chunk name, bytes
_HEADER = struct.Struct(f"<{_FIELDS.size}s{MAC_BYTES}s")  # the fields, their MAC with the bytes


class DiskTier:
    """Chunk files under `root/<layout fingerprint>/`, one per chunk, written whole to a
    temporary name and renamed (a crash leaves no file a later run trusts), each with a
    header naming its layout and chunk and a MAC of both and its bytes under the deployment's
    key. Any file that does not check out is a miss: counted, logged once, removed. A full
    disk or an unwritable directory turns writing off with a warning; reading goes on (with
    no key to check files against, nothing is read). A directory anyone may write to, or a
    key others may read, is refused (DiskTrustError)."""

    def __init__(
        self,
        root: str | Path,
        layout: TierLayout,
        capacity_bytes: int,
        on_change: Callable[[str, bytes], None] = lambda kind, name: None,
    ) -> None:
        self.layout = layout
        self.fingerprint = layout.fingerprint
        self.dir = Path(root) / self.fingerprint.hex()
        self.capacity_bytes = capacity_bytes
        self.file_nbytes = _HEADER.size + layout.chunk_nbytes
        self.writable = True
        self.exists = True  # a directory is configured (tiers.py runs its threads)
        self.num_bad_files = 0
        self.num_writes = 0
        self.num_write_errors = 0
        self._warned: set[str] = set()
        self._index: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._lock = threading.Lock()  # the index: the writer thread and the loop both use it
        self.on_change = on_change  # ("stored" | "removed", name): KV events
        self._key = b""  # the deployment's secret; none: every file is a miss
        try:
            self._open(Path(root))
        except OSError as err:
            self._stop_writing(f"cannot use {self.dir}: {err}")

    def _open(self, root: Path) -> None:
        """Check the directories, get the key, index what is there (OSError: unusable)."""
        for folder in (root, self.dir):  # a new one only its user may enter
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_directory(folder)
        self._key = deployment_key(root)
        self._scan()

    def __len__(self) -> int:
        return len(self._index)

    @property
    def root(self) -> Path:
        """The directory engines share (this layout's files are in a folder under it)."""
        return self.dir.parent

    def path(self, name: bytes) -> Path:
        return self.dir / chunk_file(name.hex())

    def contains(self, name: bytes) -> bool:
        """Known here, or written by another engine sharing the directory since the scan."""
        if name in self._index:
            return True
        if _is_regular(self.path(name)):
            self._remember(name)
            self._changed("stored", name)
            return True
        return False

    def names(self) -> list[bytes]:
        """Every chunk known here, oldest first."""
        with self._lock:
            return list(self._index)

    def write(self, name: bytes, chunk: torch.Tensor) -> bool:
        """Write one chunk (writer thread). False if writing is off or failed."""
        if not self.writable or not self._key:
            return False
        payload = chunk.contiguous().view(torch.uint8).numpy().tobytes()
        fields = _FIELDS.pack(_MAGIC, self.fingerprint, name, len(payload))
        header = _HEADER.pack(fields, chunk_mac(self._key, fields, payload))
        final = self.path(name)
        tmp = final.with_name(f"{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self._make_room()
            self._write_file(tmp, header + payload)
            os.replace(tmp, final)
        except OSError as err:
            self.num_write_errors += 1
            tmp.unlink(missing_ok=True)
            if err.errno in _LASTING_ERRORS:  # it would fail again: stop writing, keep serving
                reason = "the disk is full" if err.errno == errno.ENOSPC else str(err)
                self._stop_writing(f"writing KV chunks to {self.dir} failed ({reason})")
            return False
        self._remember(name)
        self._changed("stored", name)
        self.num_writes += 1
        return True

    @staticmethod
    def _write_file(path: Path, data: bytes) -> None:
        # a new file of ours: never through a symlink planted at the temporary name
        write_exclusive(path, data)

    def read(self, name: bytes) -> torch.Tensor | None:
        """The chunk, or None if its file is missing or does not check out (a miss). Reads
        at most one chunk file's size, from a regular file only, and never blocks on it."""
        path = self.path(name)
        if not self._key:
            return None
        try:
            data = read_bounded(path, self.file_nbytes)
        except FileNotFoundError:
            with self._lock:
                known = self._index.pop(name, 0) is None
            if known:
                self._changed("removed", name)
            return None
        except (UntrustedFile, OSError) as err:
            self._bad(name, path, f"unreadable: {err}" if isinstance(err, OSError) else str(err))
            return None
        fields, mac = _HEADER.unpack_from(data)
        magic, fingerprint, stored_name, nbytes = _FIELDS.unpack(fields)
        payload = memoryview(data)[_HEADER.size :]
        if magic != _MAGIC or fingerprint != self.fingerprint or stored_name != name:
            self._bad(name, path, "written for another model, layout or chunk")
            return None
        if nbytes != len(payload) or not macs_equal(chunk_mac(self._key, fields, payload), mac):
            self._bad(name, path, "its MAC does not check out (corrupt, or not written here)")
            return None
        self._remember(name)
        chunk = torch.frombuffer(bytearray(payload), dtype=self.layout.dtype)
        return chunk.view(self.layout.chunk_shape)

    def _scan(self) -> None:
        """Index the files a previous run (or another engine) left; drop unfinished writes."""
        files = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                if not _writer_alive(entry.name):  # a write that never finished
                    Path(entry.path).unlink(missing_ok=True)
            elif (
                entry.name.endswith(".kv")
                and len(entry.name) == 2 * NAME_BYTES + 3
                and entry.is_file(follow_symlinks=False)
            ):
                files.append((entry.stat().st_mtime, bytes.fromhex(entry.name[:-3])))
        for _, name in sorted(files):
            self._index[name] = None

    def _remember(self, name: bytes) -> None:
        with self._lock:
            self._index[name] = None
            self._index.move_to_end(name)

    def _make_room(self) -> None:
        """Remove the least recently used files until one more fits the capacity."""
        while True:
            with self._lock:
                if (
                    not self._index
                    or (len(self._index) + 1) * self.file_nbytes <= self.capacity_bytes
                ):
                    return
                name, _ = self._index.popitem(last=False)
            self.path(name).unlink(missing_ok=True)
            self._changed("removed", name)

    def _bad(self, name: bytes, path: Path, why: str) -> None:
        self.num_bad_files += 1
        with self._lock:
            known = self._index.pop(name, 0) is None
        try:
            path.unlink(missing_ok=True)
        except OSError:  # a directory under a chunk's name, say: a miss all the same
            pass
        if known:
            self._changed("removed", name)
        self._warn_once(
            "bad",
            f"KV chunk file {path} is not used: {why}; its tokens are "
            "computed instead (further bad files are counted, not logged)",
        )

    def _changed(self, kind: str, name: bytes) -> None:
        self.on_change(kind, name)

    def _stop_writing(self, message: str) -> None:
        self.writable = False
        self._warn_once(
            "write", f"{message}; KV chunks are no longer written to disk, serving goes on"
        )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


class NoDiskTier:
    """No disk directory: nothing is there, nothing is written, no thread is needed."""

    root = None
    writable = False
    exists = False  # no directory configured
    capacity_bytes = 0
    file_nbytes = 1
    num_bad_files = num_writes = num_write_errors = 0

    def __len__(self) -> int:
        return 0

    def contains(self, name: bytes) -> bool:
        return False

    def names(self) -> list[bytes]:
        return []

    def read(self, name: bytes) -> torch.Tensor | None:
        return None

    def write(self, name: bytes, chunk: torch.Tensor) -> bool:
        return False


def _is_regular(path: Path) -> bool:
    """A regular file itself, not a symlink to one (nor a FIFO, which read would refuse)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that is writing `<chunk>.kv.<pid>.<thread>.tmp` still runs (an
    engine sharing the directory); a crashed writer's file is removed."""
    parts = tmp_name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True
