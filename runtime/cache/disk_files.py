"""What the disk tier trusts of its directory: nothing it reads, until it checks out.

Chunk files are read only if they are regular files (never through a symlink, never a FIFO
or a device, opened non-blocking so none can stall the reader), and never past the size a
chunk of the layout has. Each file carries a keyed MAC of its header (layout, chunk name,
size) and bytes under the deployment's secret: a file copied, moved or crafted under another
chunk's name fails it, since names are computable but the key is not. The key lives in the
directory (`KEY_FILE`, made 0600 on first use); a directory anyone may write to is refused.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
import threading
from pathlib import Path

from runtime.errors import UsageError

KEY_FILE = "flowlang-kv.key"  # in the --disk-kv-dir root, shared by every layout's folder
KEY_BYTES = 32
MAC_BYTES = 32
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class DiskTrustError(UsageError):
    """A --disk-kv-dir, or its key, that others may write or read: the disk tier refuses it."""


class UntrustedFile(Exception):
    """A chunk file that is not read: the message says why (a miss, never a failure)."""


def read_bounded(path: Path, nbytes: int) -> bytes:
    """The bytes of the regular file `path`, which must be exactly `nbytes` long. Raises
    FileNotFoundError, UntrustedFile (a symlink, FIFO, device, directory, wrong size) or
    OSError; reads at most `nbytes + 1` bytes whatever is there."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UntrustedFile("a symlink, not a file") from err
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile("not a regular file (a FIFO, directory, device or socket)")
        if info.st_size != nbytes:
            raise UntrustedFile(f"{info.st_size} bytes, expected {nbytes} (truncated?)")
        os.set_blocking(fd, True)  # a regular file: reads return what is there
        parts, left = [], nbytes + 1  # one byte more: a file that grew since fstat shows it
        while left > 0 and (part := os.read(fd, min(left, 1 << 20))):
            parts.append(part)
            left -= len(part)
    finally:
        os.close(fd)
    data = b"".join(parts)
    if len(data) != nbytes:
        raise UntrustedFile(f"{len(data)} bytes, expected {nbytes} (changed while read?)")
    return data


def write_exclusive(path: Path, data: bytes) -> None:
    """Create `path` (never an existing file or a symlink's target), 0600, holding `data`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def chunk_mac(key: bytes, header: bytes, payload: bytes | memoryview) -> bytes:
    """The keyed MAC of a chunk file: its header fields (layout, name, size) and its bytes."""
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def macs_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


def check_directory(path: Path) -> None:
    """Refuse a directory every user may write to: anyone could remove or plant files, or a
    key of their own before the first engine makes one."""
    mode = os.stat(path).st_mode
    if mode & stat.S_IWOTH:
        raise DiskTrustError(
            f"--disk-kv-dir: {path} is writable by every user (mode {stat.filemode(mode)}); "
            "use a directory that only the serving user may write to (chmod o-w)"
        )


def deployment_key(root: Path) -> bytes:
    """The secret that signs chunk files in `root`: read, or made (0600) on first use. Raises
    DiskTrustError for a key another user owns or may read, OSError if it cannot be had."""
    path = root / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    tmp = path.with_name(f"{KEY_FILE}.{os.getpid()}.{threading.get_ident()}.new")
    write_exclusive(tmp, secrets.token_bytes(KEY_BYTES))
    try:
        os.link(tmp, path)  # atomic and never replaces: an engine sharing root may be first
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DiskTrustError(f"--disk-kv-dir: the key {path} is a symlink") from err
        raise
    try:
        info = os.fstat(fd)
        data = os.read(fd, KEY_BYTES + 1) if stat.S_ISREG(info.st_mode) else b""
    finally:
        os.close(fd)
    if not stat.S_ISREG(info.st_mode) or len(data) != KEY_BYTES:
        raise DiskTrustError(
            f"--disk-kv-dir: {path} is not a {KEY_BYTES}-byte key file; remove it (a new one "
            "is made, and chunk files signed with the old one become misses)"
        )
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise DiskTrustError(
            f"--disk-kv-dir: the key {path} is owned by uid {info.st_uid} with mode "
            f"{stat.filemode(info.st_mode)}; it must be the serving user's, mode 0600 "
            "(whoever can read it can forge KV chunk files)"
        )
    return data
