"""Pins held over HTTP: owned by a client, kept alive by renewals, released on unpin or when
the lease runs out (a crashed client never leaves a prefix locked forever)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

from runtime.engine_api import EngineAPI
from runtime.errors import UnknownRequestError
from runtime.handles import PinHandle
from runtime.server.errors import TooManyRequestsError


@dataclass
class Lease:
    handle: PinHandle
    owner: str
    expires_at: float
    lease_seconds: float


class PinLeases:
    """The pins held over HTTP, by id; an id the caller does not hold is an UnknownRequestError."""

    def __init__(
        self,
        engine: EngineAPI,
        default_lease_seconds: float = 30.0,
        max_tokens_per_owner: int | None = None,
    ) -> None:
        self.engine = engine
        self.default_lease_seconds = default_lease_seconds
        self.max_tokens_per_owner = max_tokens_per_owner  # None: no quota
        self._leases: dict[str, Lease] = {}
        self._reserved_tokens: Counter[str] = Counter()  # by owner: pins still prefilling
        self._lock = threading.Lock()
        self.num_expired = 0

    def reserve(self, owner: str, num_tokens: int) -> None:
        """Take `num_tokens` of `owner`'s pinned-token quota for a pin about to be prefilled,
        or refuse (429) a pin that would take it past the quota: one tenant must not hold the
        pool that every other tenant's requests need. Checked and taken at once, so that
        concurrent pins cannot all pass the check before any of them holds its lease. The
        reservation ends in `add` (the pin is held) or `unreserve` (it failed). An engine
        without a prefix cache holds no pin's tokens: its pins reserve 0 and count 0."""
        quota = self.max_tokens_per_owner
        with self._lock:
            held = self._reserved_tokens[owner] + sum(
                lease.handle.info.num_tokens
                for lease in self._leases.values()
                if lease.owner == owner and lease.handle.info.held
            )
            if quota is not None and held + num_tokens > quota:
                raise TooManyRequestsError(
                    f"pinning {num_tokens} more tokens would exceed this API key's quota of "
                    f"{quota} pinned tokens ({held} held); release a pin first"
                )
            self._reserved_tokens[owner] += num_tokens

    def unreserve(self, owner: str, num_tokens: int) -> None:
        """Give back a reservation whose pin failed."""
        with self._lock:
            self._reserved_tokens[owner] -= num_tokens

    def add(
        self, handle: PinHandle, owner: str, lease_seconds: float | None, reserved_tokens: int
    ) -> Lease:
        """Hold `handle` under a lease, in place of the `reserved_tokens` reserved for it."""
        seconds = lease_seconds or self.default_lease_seconds
        lease = Lease(handle, owner, time.monotonic() + seconds, seconds)
        with self._lock:
            self._reserved_tokens[owner] -= reserved_tokens
            self._leases[handle.pin_id] = lease
        return lease

    def renew(self, pin_id: str, owner: str) -> Lease:
        with self._lock:
            lease = self._owned(pin_id, owner)
            lease.expires_at = time.monotonic() + lease.lease_seconds
            return lease

    def release(self, pin_id: str, owner: str) -> None:
        with self._lock:
            lease = self._owned(pin_id, owner)
            del self._leases[pin_id]
        lease.handle.release()

    def expire(self) -> int:
        """Release every lease past its time; returns how many."""
        now = time.monotonic()
        with self._lock:
            expired = [pid for pid, lease in self._leases.items() if lease.expires_at < now]
            leases = [self._leases.pop(pid) for pid in expired]
        for lease in leases:
            lease.handle.release()
        self.num_expired += len(leases)
        return len(leases)

    def release_all(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            lease.handle.release()

    def __len__(self) -> int:
        return len(self._leases)

    def _owned(self, pin_id: str, owner: str) -> Lease:
        lease = self._leases.get(pin_id)
        if lease is None or lease.owner != owner:
            raise UnknownRequestError(f"no pin {pin_id!r} held by this client")
        return lease
