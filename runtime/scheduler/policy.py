"""Waiting-queue order, by name: fcfs, lpm, dfs-weight, lof, random, priority.

Cache-aware policies need each waiting request's current match in the radix tree. Matches are
kept incrementally: a request is re-matched only when the tree reports that the node its last
match ended at has changed (`RadixCache.match_is_current`), so LPM stays exact and cheap at
10,000 waiting requests instead of switching itself off.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator, Mapping

from runtime.cache.base import PrefixCache
from runtime.cache.nodes import TreeNode, TreePosition
from runtime.config import SCHEDULE_POLICIES
from runtime.scheduler.request import Req


class QueuedReads:
    """What the waiting queue reads, in admission order: each waiting request with its
    current cache match. Graph eviction's marks read it right before they evict, and the
    lookahead prefetches for its head; both iterate lazily (ordering is not free, and a random
    order draws only when asked). The queue is the scheduler's: read here, never changed."""

    def __init__(self, waiting: Mapping[str, Req], policy: SchedulePolicy) -> None:
        self.waiting = waiting
        self.policy = policy

    def matches(self) -> Iterator[tuple[Req, TreePosition]]:
        if not self.waiting:
            return
        for req in self.policy.order(list(self.waiting.values())):
            yield req, self.policy.match(req)

    def positions(self) -> Iterator[TreePosition]:
        return (position for _, position in self.matches())


class SchedulePolicy:
    """Orders the waiting queue each step."""

    def __init__(self, name: str, cache: PrefixCache, seed: int = 0) -> None:
        if name not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {name!r}; choose from {SCHEDULE_POLICIES}")
        self.name = name
        self.cache = cache
        self._rng = random.Random(seed)
        self.num_rematches = 0  # match_prefix calls spent on keeping matches current

    @property
    def cache_aware(self) -> bool:
        return self.name in ("lpm", "dfs-weight") and self.cache.can_share

    def order(self, waiting: list[Req]) -> list[Req]:
        """The waiting requests in the order admission should try them; members of a fork
        group stay together, at the place of their first member, so branches co-run."""
        return _group_forks(self._order(waiting))

    def _order(self, waiting: list[Req]) -> list[Req]:
        if self.name == "fcfs" or (not self.cache_aware and self.name in ("lpm", "dfs-weight")):
            return sorted(waiting, key=_fcfs_key)
        if self.name == "lof":
            return sorted(waiting, key=lambda r: (-r.remaining_new_tokens, *_fcfs_key(r)))
        if self.name == "priority":
            return sorted(waiting, key=lambda r: (-r.hints.priority, *_fcfs_key(r)))
        if self.name == "random":
            shuffled = list(waiting)
            self._rng.shuffle(shuffled)
            return shuffled
        for req in waiting:
            self.match(req)
        if self.name == "lpm":
            return sorted(waiting, key=lambda r: (-r.queue.match_pos.prefix_len, *_fcfs_key(r)))
        return self._dfs_weight(waiting)

    def match(self, req: Req) -> TreePosition:
        """The request's current cache match, re-matching only if its tree position changed
        (so ordering, admission and eviction marks share one match per change)."""
        if req.queue.match_pos is None or not self.cache.match_is_current(
            req.queue.match_pos, req.queue.match_version
        ):
            match = self.cache.match_prefix(req.all_ids[: req.match_limit], req.namespace)
            self.num_rematches += 1
            req.queue.match_pos = match.position
            req.queue.match_version = match.position.node.version
        return req.queue.match_pos

    def _dfs_weight(self, waiting: list[Req]) -> list[Req]:
        """Depth-first over the tree, heavier subtrees (more waiting requests) first, so that
        requests sharing a prefix are admitted together."""
        at_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        children: dict[int, set[TreeNode]] = defaultdict(set)
        roots: dict[int, TreeNode] = {}
        for req in waiting:
            node = req.queue.match_pos.node
            at_node[id(node)].append(req)
            while True:
                weight[id(node)] += 1
                if node.parent is None:
                    roots[id(node)] = node
                    break
                children[id(node.parent)].add(node)
                node = node.parent
        ordered: list[Req] = []
        stack = sorted(roots.values(), key=lambda n: weight[id(n)])
        while stack:
            node = stack.pop()
            ordered.extend(sorted(at_node.get(id(node), ()), key=_fcfs_key))
            stack.extend(sorted(children.get(id(node), ()), key=lambda n: weight[id(n)]))
        return ordered


def _group_forks(ordered: list[Req]) -> list[Req]:
    groups: dict[str, list[Req]] = {}
    for req in ordered:
        group = req.hints.fork_group_id
        if group is not None:
            groups.setdefault(group, []).append(req)
    if not groups:
        return ordered
    result, placed = [], set()
    for req in ordered:
        group = req.hints.fork_group_id
        if group is None:
            result.append(req)
        elif group not in placed:
            placed.add(group)
            result.extend(groups[group])
    return result


def _fcfs_key(req: Req) -> tuple[int, int]:
    # retracted requests go back to the front: they had been admitted before anything waiting
    return (0 if req.queue.num_retractions else 1, req.arrival)
