"""Building an engine's prefix cache from its config: the tree, its eviction policy, the marks
that tell the policy the future, and the listeners the tree tells its changes to.

The tree is built once with every listener it will ever have (tree_events.py): the KV event
publisher (always: it costs nothing until someone subscribes), speculation's token index
(`speculative="tree"`), and demotion of what eviction takes to the lower tiers (when they keep
it). With `disable_radix_cache` the cache is the null one, and listens to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from runtime.cache.allocator import SlotAllocator
from runtime.cache.base import NullCache, PrefixCache
from runtime.cache.events import KVEventPublisher
from runtime.cache.graph_policy import GraphMarks
from runtime.cache.lower import LowerTiers
from runtime.cache.oracle import OracleMarks
from runtime.cache.policy_base import NoMarks
from runtime.cache.radix import RadixCache
from runtime.cache.token_index import TokenIndex
from runtime.cache.tree_events import LeafEvicted, TreeListener
from runtime.config import EngineConfig

# the policies whose marks tell them the future; every other one gets NoMarks
MARKS = {"graph": GraphMarks, "oracle": OracleMarks}


class TierDemotion(TreeListener):
    """What the tree evicts moves down to the lower tiers, read while its slots still hold it."""

    def __init__(self, tiers: LowerTiers) -> None:
        self.tiers = tiers

    def leaf_evicted(self, event: LeafEvicted) -> None:
        self.tiers.demote(event.namespace, event.path, event.start, event.path_slots)


@dataclass(frozen=True)
class PrefixCacheParts:
    cache: PrefixCache
    marks: NoMarks  # what the KV manager tells the eviction policy of the future
    token_index: TokenIndex | None  # speculative drafts' index of the tree; None: no drafts
    kv_events: KVEventPublisher  # the tree's changes, for subscribers (none: nothing built)


def build_prefix_cache(
    config: EngineConfig,
    allocator: SlotAllocator,
    tiers: LowerTiers,
    listeners: Iterable[TreeListener] = (),
) -> PrefixCacheParts:
    """The cache for `config` over `allocator`, telling its KV event publisher, then
    `listeners`, the token index and the lower tiers of its changes."""
    kv_events = KVEventPublisher()  # from the start: it builds nothing until a subscriber
    if config.disable_radix_cache:
        return PrefixCacheParts(NullCache(allocator), NoMarks(), None, kv_events)
    listeners = [kv_events, *listeners]
    token_index = TokenIndex(allocator.num_slots) if config.speculative == "tree" else None
    if token_index is not None:
        listeners.append(token_index)
    if tiers.keeps_evicted:
        listeners.append(TierDemotion(tiers))
    cache = RadixCache(allocator, config.page_size, config.eviction_policy, listeners)
    marks = MARKS.get(config.eviction_policy)
    return PrefixCacheParts(cache, marks(cache) if marks else NoMarks(), token_index, kv_events)
