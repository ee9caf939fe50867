"""Fair shares of the KV pool between owners (tenants: `owner_of` a request's namespace).

Admission lets another owner's request that fits pass one that does not (scheduler.py), but a
request that fits nowhere waits for room, and running requests keep their room until they end:
one owner's long requests (n copies of a 4,000-token answer, say) could hold the whole pool for
minutes while another owner's one-token request waits. So each owner is promised an even share
of the pool among the owners with work; when an owner within its share has a waiting request
that does not fit, the latest-admitted running requests of owners over their share are
retracted (their KV stays in the tree, unlocked, for their return: scheduler.retract) until it
fits. With one owner nothing here ever acts.

An owner's claim is what its running requests hold and still reserve (tokens plus the growth
reserve admission counts): the same units as admission's `need`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

from runtime.cache.nodes import owner_of
from runtime.scheduler.request import Req

if TYPE_CHECKING:
    from runtime.scheduler.scheduler import Scheduler


# an owner whose request arrived this recently counts as active: a step already under way when
# its next request comes cannot be cut short, so steps stay short while tenants take turns
ACTIVE_OWNER_S = 10.0
MIN_SHARED_TOKENS = 16  # a shared step's prompt tokens however slow steps are: progress
UNMEASURED_SHARED_TOKENS = 64  # before the step cost is known (the first few steps)


class OwnerActivity:
    """When each owner's latest request arrived (at most the owners active within
    ACTIVE_OWNER_S, and the one that just came)."""

    def __init__(self) -> None:
        self._last_s: dict[Hashable, float] = {}

    def saw(self, req: Req) -> None:
        owner, now_s = owner_of(req.namespace), time.monotonic()
        self._last_s.pop(owner, None)
        self._last_s[owner] = now_s  # (insertion order: the stalest first)
        while next(iter(self._last_s.values())) < now_s - ACTIVE_OWNER_S:
            del self._last_s[next(iter(self._last_s))]

    def shared(self, current: Iterable[Req]) -> bool:
        """Whether more than one owner is active: has a `current` (running or waiting)
        request or one that arrived within ACTIVE_OWNER_S (stops at the second owner seen:
        this is asked every step)."""
        since_s = time.monotonic() - ACTIVE_OWNER_S
        recent = (owner for owner, last_s in self._last_s.items() if last_s >= since_s)
        owners = chain(recent, (owner_of(r.namespace) for r in current))
        first = next(owners, None)  # (None is an owner too: no key)
        return any(owner != first for owner in owners)


def step_tokens(s: Scheduler) -> tuple[int, bool]:
    """The step's prefill budget, and whether owners share the step: while more than one
    owner is active (their requests run, wait or arrived within ACTIVE_OWNER_S) what fits in
    `shared_step_ms` by the measured step cost (step_time.py), so no owner's long prompt or
    forced text holds another's next token for long; `chunked_prefill_tokens` for one owner."""
    if not s.activity.shared(chain(s.running, s.waiting.values())):
        return s.config.chunked_prefill_tokens, False
    return shared_step_tokens(s), True


def shared_step_tokens(s: Scheduler) -> int:
    """The prompt tokens a step of `shared_step_ms` computes by the measured step cost (at
    least MIN_SHARED_TOKENS, at most `chunked_prefill_tokens`)."""
    config = s.config
    fitting = s.step_time.tokens_within(config.shared_step_ms / 1000)
    shared = UNMEASURED_SHARED_TOKENS if fitting is None else max(MIN_SHARED_TOKENS, fitting)
    return min(config.chunked_prefill_tokens, shared)


def fair_share_victims_of(s: Scheduler) -> list[Req]:
    """The scheduler's running requests to retract before this step (fair_share_victims)."""
    if not s.waiting or not s.running:
        return []
    reserved = sum(map(s.reserved_slots, s.running))
    return fair_share_victims(
        s.running,
        list(s.waiting.values()),
        s.kv.allocator.num_slots,
        claim_of=lambda r: r.num_tokens + s.growth_reserve(r),
        need_of=s.need,
        available_slots=s.kv.available_slots(reserved),
    )


def fair_share_victims(
    running: Sequence[Req],
    waiting: Sequence[Req],
    num_slots: int,
    claim_of: Callable[[Req], int],
    need_of: Callable[[Req], int],
    available_slots: int,
) -> list[Req]:
    """Running requests to retract, latest admitted first, so that the first waiting request
    (by arrival) of an owner within its share fits: only requests of owners over their share,
    only as many as make it fit by their claims, and none if even all of them would not.
    (Arrival, not the schedule policy's order: a random policy's draws stay admission's.)"""
    owners = {owner_of(r.namespace) for r in (*running, *waiting)}
    if len(owners) < 2 or not running:
        return []
    share_slots = num_slots // len(owners)
    claims: Counter[Hashable] = Counter()
    for req in running:
        claims[owner_of(req.namespace)] += claim_of(req)
    latest_first = sorted(running, key=lambda r: r.queue.admit_seq, reverse=True)
    seen: set[Hashable] = set()
    for req in sorted(waiting, key=lambda r: r.arrival):
        owner = owner_of(req.namespace)
        if owner in seen:
            continue  # an owner's later requests start after its first one
        seen.add(owner)
        need = need_of(req)
        if need <= available_slots or claims[owner] + need > share_slots:
            continue  # it fits already, or its owner is at its share: it waits its turn
        missing_slots = need - available_slots
        victims = _freeing(latest_first, claims, claim_of, share_slots, owner, missing_slots)
        if victims:
            return victims
    return []


def _freeing(
    latest_first: Sequence[Req],
    claims: Counter[Hashable],
    claim_of: Callable[[Req], int],
    share_slots: int,
    needy_owner: Hashable,
    missing_slots: int,
) -> list[Req]:
    """The fewest latest-admitted requests of over-share owners whose claims cover
    `missing_slots`, taking none from an owner once it is within its share; [] if they
    cannot (retracting them would help nobody)."""
    left = Counter(claims)
    victims: list[Req] = []
    freed_slots = 0
    for req in latest_first:
        owner = owner_of(req.namespace)
        if owner == needy_owner or left[owner] <= share_slots:
            continue
        claim = claim_of(req)
        victims.append(req)
        left[owner] -= claim
        freed_slots += claim
        if freed_slots >= missing_slots:
            return victims
    return []
