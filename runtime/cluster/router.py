"""The router's state: per replica, the tree its KV events describe, the prompts it is running,
and the pins it holds; `route` applies a policy (policy.py) to it.

Thread-safe (one lock): clients route from many threads while an event pump applies events.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from runtime.cache.chunks import TierView
from runtime.cache.events import KVEvent, KVSnapshot
from runtime.cluster.homes import ProgramHomes
from runtime.cluster.mirror import MirrorTree
from runtime.cluster.policy import (
    RouterConfig,
    choose_approximate,
    choose_cache_aware,
    least_loaded,
)
from runtime.prefix import common_prefix_len

ReplicaId = Hashable


class NoReplicaError(RuntimeError):
    """No live replica to route to (all died, or none was added)."""


@dataclass
class _Replica:
    tree: MirrorTree  # exact: fed by the replica's KV events
    approx: MirrorTree  # `approximate` policy: every prompt routed here, never evicted
    capacity_tokens: int | None  # its KV pool (None: unknown, never priced as evicting)
    running: dict[str, tuple[Hashable, tuple[int, ...]]] = field(default_factory=dict)
    new_tokens: dict[str, int] = field(default_factory=dict)  # running: what each computes
    pinned: dict[str, tuple[Hashable, tuple[int, ...]]] = field(default_factory=dict)  # by pin
    computing_tokens: int = 0  # their sum: KV being written, not yet in the tree
    # finished requests whose insert events have not arrived: (event seq, rid)
    unconfirmed: list[tuple[int, str]] = field(default_factory=list)

    def start(self, rid: str, namespace: Hashable, ids: tuple[int, ...], new: int) -> None:
        self.running[rid] = (namespace, ids)
        self.new_tokens[rid] = new
        self.computing_tokens += new

    def end(self, rid: str) -> None:
        self.running.pop(rid, None)
        self.computing_tokens -= self.new_tokens.pop(rid, 0)

    def evictions(self, new: int) -> int:
        """Tokens that admitting `new` more would evict (cached + being computed > pool)."""
        if self.capacity_tokens is None:
            return 0
        return max(0, self.tree.num_tokens + self.computing_tokens + new - self.capacity_tokens)


class Router:
    """Chooses a replica per request; honours pins and placement preferences.

    >>> router = Router(RouterConfig(policy="round_robin"))
    >>> router.add_replica("r0"); router.add_replica("r1")
    >>> [router.route(f"q{i}", [1, 2, 3]) for i in range(3)]
    ['r0', 'r1', 'r0']
    """

    def __init__(self, config: RouterConfig | None = None, page_size: int = 1) -> None:
        self.config = config or RouterConfig()
        self.page_size = page_size
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._rid_replica: dict[str, ReplicaId] = {}
        self._pin_replica: dict[str, ReplicaId] = {}  # pin id -> where (its prefix: `pinned`)
        self._homes = ProgramHomes()  # (namespace, program id) -> the replica it last ran on
        self._turn = itertools.count()
        self._lock = threading.Lock()
        # replicas with lower KV tiers: how they name chunks, and the disk they share
        self.lower_tiers: TierView | None = None

    # ---------------------------------------------------------------- membership
    @property
    def replica_ids(self) -> list[ReplicaId]:
        """Live replicas, in the order they were added."""
        with self._lock:
            return list(self._replicas)

    def add_replica(
        self,
        replica_id: ReplicaId,
        snapshot: KVSnapshot | None = None,
        capacity_tokens: int | None = None,
    ) -> None:
        """Start routing to a replica whose tree is `snapshot` (empty if None) and whose KV
        pool holds `capacity_tokens` (None: unknown)."""
        tree = MirrorTree(self.page_size)
        if snapshot is not None:
            tree.load(snapshot)
        with self._lock:
            if replica_id in self._replicas:
                raise ValueError(f"replica {replica_id!r} is already routed to")
            self._replicas[replica_id] = _Replica(tree, MirrorTree(self.page_size), capacity_tokens)

    def remove_replica(self, replica_id: ReplicaId) -> list[str]:
        """Drop a (dead) replica, its tree and its pins; return the request ids it was running
        (the caller re-runs them elsewhere)."""
        with self._lock:
            replica = self._replicas.pop(replica_id)
            for rid in replica.running:
                del self._rid_replica[rid]
            for pin_id in replica.pinned:
                del self._pin_replica[pin_id]
            self._homes.drop_replica(replica_id)
            return list(replica.running)

    def resync(self, replica_id: ReplicaId, snapshot: KVSnapshot) -> None:
        """Replace a replica's tree with a fresh snapshot (after lost events)."""
        with self._lock:
            replica = self._replicas[replica_id]
            replica.tree.load(snapshot)
            self._confirm(replica)

    def apply_events(self, replica_id: ReplicaId, events: Iterable[KVEvent]) -> None:
        """Follow a replica's tree; raises MirrorDesyncError on a gap (then `resync`)."""
        with self._lock:
            replica = self._replicas.get(replica_id)
            if replica is not None:  # events still in flight from a replica just removed
                replica.tree.apply_all(events)
                self._confirm(replica)

    # ---------------------------------------------------------------- routing
    def route(
        self,
        rid: str,
        token_ids: Sequence[int],
        namespace: Hashable = None,
        prefer: ReplicaId | None = None,
        program: Hashable = None,
    ) -> ReplicaId:
        """Pick a replica for a request and count it as running there until `finish(rid)`.
        `prefer` (a placement's choice), if live, wins; else the policy decides, keeping the
        request's `program` (its graph's program id) on its home (homes.py) or a request that
        extends a live pin on the pin's replica (`_destination`)."""
        ids = tuple(token_ids)
        names: list[str] = []  # the prompt's chunks below the pool, and how many are on disk
        on_disk = 0  # probed outside the lock: it reads directory entries
        if self.lower_tiers is not None and self.config.policy == "cache_aware":
            names = self.lower_tiers.names(namespace, ids)
            on_disk = self.lower_tiers.tokens_on_disk(names)
        with self._lock:
            if not self._replicas:
                raise NoReplicaError("no live replica to route to")
            if rid in self._rid_replica:
                raise ValueError(f"request id {rid!r} is already routed")
            key = None if program is None else (namespace, program)
            chosen = prefer
            if prefer not in self._replicas:
                chosen = self._destination(ids, namespace, names, on_disk, key)
            if key is not None:
                self._homes.record(key, chosen)
            replica = self._replicas[chosen]
            replica.start(rid, namespace, ids, len(ids) - self._match_len(replica, ids, namespace))
            if self.config.policy == "approximate":
                replica.approx.insert(ids, namespace)
            self._rid_replica[rid] = chosen
            return chosen

    def finish(self, rid: str, after_seq: int | None = None) -> None:
        """The request ended: it no longer loads its replica. With `after_seq` (the replica's
        event seq when it answered), its prompt keeps counting as cached there until that
        event has been applied, so no request in between misses what it inserted."""
        with self._lock:
            replica_id = self._rid_replica.get(rid)
            if replica_id is None:
                return
            replica = self._replicas[replica_id]
            if after_seq is not None and replica.tree.last_seq < after_seq:
                replica.unconfirmed.append((after_seq, rid))
                return
            del self._rid_replica[rid]
            replica.end(rid)

    def replica_of(self, rid: str) -> ReplicaId | None:
        """Where a routed request runs (None once finished)."""
        with self._lock:
            return self._rid_replica.get(rid)

    def place_pin(
        self,
        pin_id: str,
        replica_id: ReplicaId,
        prefix_ids: Sequence[int] = (),
        namespace: Hashable = None,
    ) -> None:
        """Record that a pin of `prefix_ids` lives on `replica_id`: requests that extend the
        prefix (its readers, e.g. a fork's branches) go there."""
        with self._lock:
            if replica_id in self._replicas:  # (else it died meanwhile: its pins went too)
                self._pin_replica[pin_id] = replica_id
                self._replicas[replica_id].pinned[pin_id] = (namespace, tuple(prefix_ids))

    def release_pin(self, pin_id: str) -> None:
        """Forget a released pin."""
        with self._lock:
            replica_id = self._pin_replica.pop(pin_id, None)
            if replica_id is not None:
                del self._replicas[replica_id].pinned[pin_id]

    def replica_of_pin(self, pin_id: str) -> ReplicaId | None:
        """Where a pin lives, or None if unknown (released, or its replica died)."""
        with self._lock:
            return self._pin_replica.get(pin_id)

    # ---------------------------------------------------------------- reads
    def loads(self) -> dict[ReplicaId, int]:
        """Requests in flight per replica."""
        with self._lock:
            return {r: len(rep.running) for r, rep in self._replicas.items()}

    def match_lens(self, token_ids: Sequence[int], namespace: Hashable = None) -> dict:
        """Per replica, how much of `token_ids` it caches or is computing now."""
        ids = tuple(token_ids)
        with self._lock:
            return {r: self._match_len(rep, ids, namespace) for r, rep in self._replicas.items()}

    def program_homes(self) -> tuple[int, int]:
        """(programs whose home replica the router remembers, program turns routed away from
        the replica the program last ran on)."""
        with self._lock:
            return len(self._homes), self._homes.moves

    def tree(self, replica_id: ReplicaId) -> MirrorTree:
        """The event-fed tree of a replica (read it only while no events are applied)."""
        with self._lock:
            return self._replicas[replica_id].tree

    # ---------------------------------------------------------------- internals
    def _confirm(self, replica: _Replica) -> None:
        """Finish the requests whose insert events the tree has now applied."""
        still = []
        for seq, rid in replica.unconfirmed:
            if seq <= replica.tree.last_seq:
                self._rid_replica.pop(rid, None)
                replica.end(rid)
            else:
                still.append((seq, rid))
        replica.unconfirmed = still

    def _destination(
        self, ids: tuple[int, ...], namespace: Hashable, names: list[str], on_disk: int, key
    ) -> ReplicaId:
        """Where the policy sends a request with no placement. Its program's (`key`) last
        replica is its home, else that of the longest live pin whose prefix it extends (a
        fork's trunk; a batch's shared prefix would otherwise draw every program to one
        replica); the cache-aware rule weighs the home against the cost of the others, the
        policies without a cost model go to a pin's replica outright."""
        pin_home = self._pin_reader_replica(ids, namespace)
        if self.config.policy != "cache_aware":
            if pin_home is not None:
                return pin_home
            return self._choose(ids, namespace, names, on_disk)
        home = self._homes.home(key) if self.config.program_affinity else None
        return self._choose(ids, namespace, names, on_disk, pin_home if home is None else home)

    def _choose(
        self,
        ids: tuple[int, ...],
        namespace: Hashable,
        names: list[str],
        on_disk: int,
        home: ReplicaId | None = None,
    ) -> ReplicaId:
        replica_ids = list(self._replicas)
        loads = [len(self._replicas[r].running) for r in replica_ids]
        policy = self.config.policy
        if policy == "round_robin":
            return replica_ids[next(self._turn) % len(replica_ids)]
        if policy == "least_loaded":
            return replica_ids[least_loaded(loads)]
        if policy == "cache_aware":
            replicas = [self._replicas[r] for r in replica_ids]
            matches = [self._match_len(replica, ids, namespace) for replica in replicas]
            evictions = [r.evictions(len(ids) - m) for r, m in zip(replicas, matches, strict=True)]
            reach = None
            if names:
                reach = [
                    max(on_disk, self._host_reach(r, m, names))
                    for r, m in zip(replicas, matches, strict=True)
                ]
            at_home = replica_ids.index(home) if home in self._replicas else None
            choice = choose_cache_aware(
                matches, loads, evictions, len(ids), self.config, reach, at_home
            )
            return replica_ids[choice]
        approx = [self._replicas[r].approx for r in replica_ids]
        matches = [tree.match_len(ids, namespace) for tree in approx]
        sizes = [tree.num_tokens for tree in approx]
        return replica_ids[choose_approximate(matches, loads, sizes, len(ids), self.config)]

    def _pin_reader_replica(self, ids: tuple[int, ...], namespace: Hashable) -> ReplicaId | None:
        """The replica of the longest live pin whose prefix `ids` extends (None: none)."""
        best, best_len = None, 0
        for replica_id, replica in self._replicas.items():
            for pin_ns, prefix in replica.pinned.values():
                if pin_ns == namespace and best_len < len(prefix) <= len(ids):
                    if ids[: len(prefix)] == prefix:
                        best, best_len = replica_id, len(prefix)
        return best

    def _host_reach(self, replica: _Replica, match_len: int, names: list[str]) -> int:
        """How far the replica's host tier continues its match (its KV events say which
        chunks it holds), in tokens from the root."""
        chunk_tokens = self.lower_tiers.chunk_tokens
        held, k = replica.tree.lower["host"], match_len // chunk_tokens
        while k < len(names) and names[k] in held:
            k += 1
        return k * chunk_tokens if k > match_len // chunk_tokens else 0

    def _match_len(self, replica: _Replica, ids: tuple[int, ...], namespace: Hashable) -> int:
        """Exact cached match, or a running prompt's (its KV is being computed) or a pinned
        prefix's (held, whether or not its events have arrived), in whole pages."""
        best = replica.tree.match_len(ids, namespace)
        for running_ns, prompt in (*replica.running.values(), *replica.pinned.values()):
            if running_ns == namespace and len(prompt) > best:
                best = max(best, common_prefix_len(prompt, ids))
        return best - best % self.page_size
