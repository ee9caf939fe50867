"""How KV below the pool is laid out and named: chunks of `chunk_tokens` tokens at fixed
offsets from the root, each named by a digest chained over every token from the root, starting
from the layout's fingerprint and the namespace. Torch-free, so a router can name a prompt's
chunks too."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIN_CHUNK_TOKENS = 16  # a chunk is at least this many tokens: digests and files stay few
NAME_BYTES = 16


@dataclass(frozen=True)
class TierLayout:
    """What a chunk holds and whose it is: every field goes into the fingerprint."""

    model: str  # model identity: registry name or path, plus a digest of its weights' files
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int

    @property
    def chunk_tokens(self) -> int:
        pages = -(-MIN_CHUNK_TOKENS // self.page_size)
        return pages * self.page_size

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        # (K|V, layers, tokens, kv heads, head dim): a chunk's K (or V) for every layer is one
        # block that a gather from the pool writes directly
        return (2, self.num_layers, self.chunk_tokens, self.num_kv_heads, self.head_dim)

    @property
    def chunk_nbytes(self) -> int:
        n = self.dtype.itemsize
        for size in self.chunk_shape:
            n *= size
        return n

    @property
    def fingerprint(self) -> bytes:
        text = repr(
            (
                self.model,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                str(self.dtype),
                self.page_size,
                self.chunk_tokens,
            )
        )
        return hashlib.blake2b(text.encode(), digest_size=NAME_BYTES).digest()


def chunk_file(hex_name: str) -> str:
    """The file name of a chunk in a disk tier's directory."""
    return f"{hex_name}.kv"


def chunk_names(
    layout_fingerprint: bytes,
    namespace: Hashable,
    ids: Sequence[int],
    chunk_tokens: int,
    num_chunks: int,
    memo: list[bytes] | None = None,
) -> list[bytes]:
    """The names of the first `num_chunks` whole chunks of `ids` (fewer if `ids` is shorter).
    `memo` (the same sequence's names so far; sequences only grow) is extended in place."""
    names = memo if memo is not None else []
    num_chunks = min(num_chunks, len(ids) // chunk_tokens)
    if len(names) >= num_chunks:
        return names[:num_chunks]
    prev = names[-1] if names else root_name(layout_fingerprint, namespace)
    for k in range(len(names), num_chunks):
        chunk = ids[k * chunk_tokens : (k + 1) * chunk_tokens]
        data = struct.pack(f"<{chunk_tokens}q", *chunk)
        prev = hashlib.blake2b(prev + data, digest_size=NAME_BYTES).digest()
        names.append(prev)
    return names


def root_name(layout_fingerprint: bytes, namespace: Hashable) -> bytes:
    """What the first chunk's name is chained from: the layout and the namespace."""
    return hashlib.blake2b(
        layout_fingerprint + repr(namespace).encode(), digest_size=NAME_BYTES
    ).digest()


def tail_name(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The name of a path's last, partial chunk (`tokens`, fewer than a chunk) after the
    chunk named `prev` (or the root name): never equal to a whole chunk's name."""
    data = b"tail" + struct.pack(f"<{len(tokens)}q", *tokens)
    return hashlib.blake2b(prev + data, digest_size=NAME_BYTES).digest()


class TierView:
    """An engine's lower KV tiers seen from outside (a router): how they name a prompt's
    chunks, and how many tokens of it the disk directory they share holds (on the same
    machine or a shared filesystem), in whole chunks from the root. Reads directory entries
    only, never a file's bytes.

    Plain values: a replica sends them to its router (`describe()`)."""

    def __init__(self, root: str | Path | None, fingerprint: bytes, chunk_tokens: int) -> None:
        self.dir = Path(root) / fingerprint.hex() if root is not None else None
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens

    def describe(self) -> tuple[str | None, bytes, int]:
        root = str(self.dir.parent) if self.dir is not None else None
        return root, self.fingerprint, self.chunk_tokens

    def names(self, namespace: Hashable, ids: Sequence[int]) -> list[str]:
        """The hex names of the whole chunks of `ids` (as KV events name them)."""
        names = chunk_names(
            self.fingerprint, namespace, ids, self.chunk_tokens, len(ids) // self.chunk_tokens
        )
        return [name.hex() for name in names]

    def tokens_on_disk(self, names: Sequence[str]) -> int:
        """How many tokens from the root the directory holds, given a prompt's `names`."""
        found = 0
        for name in names:
            if self.dir is None or not (self.dir / chunk_file(name)).is_file():
                break
            found += 1
        return found * self.chunk_tokens
