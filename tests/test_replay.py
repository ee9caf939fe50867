"""Trace replay: policies compare on the same trace; farthest-next-use beats LRU on the
turn-by-turn pattern that defeats LRU (EVICTION.md); with room for everything nothing goes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.replay import replay, working_set


def turn_by_turn(num_users: int, num_turns: int) -> list[tuple]:
    """Every user's turn t, then every user's turn t+1: LRU evicts the user needed next."""
    shared = tuple(range(1000, 1010))
    history = {u: shared + (2000 + u,) * 6 for u in range(num_users)}
    events = []
    for turn in range(num_turns):
        for user in range(num_users):
            prompt = history[user] + (3000 + turn,) * 3
            events.append(("access", None, prompt, len(prompt) - 1))
            reply = (4000 + user,) * 4
            events.append(("insert", None, prompt + reply[:-1]))
            history[user] = prompt + reply
    return events


def test_farthest_next_use_beats_lru_turn_by_turn():
    trace = turn_by_turn(num_users=6, num_turns=3)
    capacity = working_set(trace) // 2
    lru, belady = replay(trace, capacity, "lru"), replay(trace, capacity, "belady")
    assert lru.hit_tokens + lru.computed_tokens == belady.hit_tokens + belady.computed_tokens
    assert belady.hit_rate > lru.hit_rate + 0.05


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.sampled_from(["lru", "graph", "belady"]))
def test_room_for_everything_means_no_eviction(users, turns, policy):
    trace = turn_by_turn(users, turns)
    result = replay(trace, working_set(trace) + 64, policy)
    reference = replay(trace, working_set(trace) + 64, "lru")
    assert result.evicted_tokens == 0 and result.hit_tokens == reference.hit_tokens
