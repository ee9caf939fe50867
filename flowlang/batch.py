"""The shared prefixes of a batch of program instances, pinned once for as long as needed."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from flowlang.backends.base import Backend, PinLease
from runtime.prefix import common_prefix_len


@dataclass
class _Pin:
    prefix: tuple[int, ...]
    readers: set[int]  # instances that will still read it
    lease: PinLease | None = None


class SharedPrefixPins:
    """Pins every branching point of the batch's prefix tree (the longest common prefix of
    each pair of neighbouring prompts in sorted order, when long enough): few-shot blocks that
    depend on arguments included. Each pin knows which instances read it and is released when
    the last of them finishes: the engine is told the future uses, not left to guess them."""

    def __init__(
        self,
        backend: Backend,
        prompts: Sequence[Sequence[int] | None],
        namespace: str | None,
        min_tokens: int,
    ) -> None:
        self.backend = backend
        self.namespace = namespace
        ordered = sorted((tuple(p), i) for i, p in enumerate(prompts) if p)
        prefixes: set[tuple[int, ...]] = set()
        for (a, _), (b, _) in zip(ordered, ordered[1:], strict=False):
            shared = common_prefix_len(a, b)
            if shared >= min_tokens:
                prefixes.add(a[:shared])
        self.pins = [
            _Pin(prefix, {i for p, i in ordered if p[: len(prefix)] == prefix})
            for prefix in sorted(prefixes, key=len)
        ]

    def acquire(self, pool: Executor) -> None:
        """Prefill and lock every shared prefix (concurrently; each is computed once)."""
        leases = pool.map(lambda pin: self.backend.pin(list(pin.prefix), self.namespace), self.pins)
        for pin, lease in zip(self.pins, leases, strict=True):
            pin.lease = lease

    def finished(self, index: int) -> None:
        """Instance `index` is done: release the pins no other instance still reads."""
        for pin in self.pins:
            if index in pin.readers:
                pin.readers.discard(index)
                if not pin.readers and pin.lease is not None:
                    pin.lease.release()
                    pin.lease = None

    def release_all(self) -> None:
        """Release every pin still held (the batch ended, or failed)."""
        for pin in self.pins:
            if pin.lease is not None:
                pin.lease.release()
                pin.lease = None
