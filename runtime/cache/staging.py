"""Chunk files read ahead for one admission: where the prefetch thread leaves what it read
from L3 for a request about to start, when L2 does not take it (there is none, or it is
for the graph's lookahead). The loop thread never reads a file (tiers.KVTiers.ready): a
request waits for its files here, and admission moves them into the pool.

Bounded: at most `capacity_chunks` chunks staged or being read; reads for later readers wait
for room rather than push out what the first readers wait for, and what nobody took (an
aborted request's) goes first, oldest first, when a read lands on a full area.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

# host memory the staged chunks may take at most (a 5,000-token prompt of the default model
# in fp32 is ~230 MB of KV)
STAGED_BYTES_MAX = 256 << 20


class StagingArea:
    """Chunks read ahead (name -> (2, layers, chunk_tokens, heads, dim)); callers lock."""

    def __init__(self, chunk_nbytes: int) -> None:
        self.capacity_chunks = max(2, STAGED_BYTES_MAX // chunk_nbytes)
        self._chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_reading = 0  # queued or being read for this area

    def __contains__(self, name: bytes) -> bool:
        return name in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def has_room(self) -> bool:
        """Whether one more read may be queued for the area."""
        return len(self._chunks) + self.num_reading < self.capacity_chunks

    def put(self, name: bytes, data: torch.Tensor) -> None:
        self._chunks[name] = data
        while len(self._chunks) > self.capacity_chunks:
            self._chunks.popitem(last=False)

    def take(self, name: bytes) -> torch.Tensor | None:
        """The chunk, no longer staged (it goes into the pool), or None."""
        return self._chunks.pop(name, None)

    def check_integrity(self) -> None:
        assert len(self._chunks) <= self.capacity_chunks, "staging area over its size"
        assert self.num_reading >= 0, "staging reads counted below zero"
