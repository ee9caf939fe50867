"""Eviction policies in the engine: on multi-turn conversations that need about three times the
KV pool (cyclic reuse), every policy, the oracle driven by a recorded run included, produces the
same outputs (eviction never changes results), the invariants hold after every round, and the
oracle and the graph policy compute less prefill than LRU."""

from __future__ import annotations

import random

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_tools import cache_trace, load_eviction_oracle
from runtime.errors import InvalidRequestError
from runtime.protocol import GenerateRequest, GraphHints, SamplingParams

NUM_USERS, NUM_TURNS, REPLY_LEN = 6, 3, 8
POOL_TOKENS = 384


def conversations(seed: int = 0) -> list[list[list[int]]]:
    """Per user, per turn, the new user-message ids (a shared 40-token system prompt first)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(40)]
    return [
        [
            (system if turn == 0 else []) + [rng.randrange(3, 500) for _ in range(30)]
            for turn in range(NUM_TURNS)
        ]
        for _ in range(NUM_USERS)
    ]


def run_rounds(policy: str, future: list[tuple] | None = None) -> tuple[list, dict, list]:
    """Every user's turn t together, then turn t + 1; each turn extends the conversation with
    the previous reply, as a program does (continuation hint while turns remain)."""
    config = EngineConfig(
        model="random:tiny",
        max_kv_tokens=POOL_TOKENS,
        eviction_policy=policy,
        record_trace=True,
        attention_backend="torch",  # the reference kernel: outputs compared across batchings
    )
    messages = conversations()
    history = [[] for _ in range(NUM_USERS)]
    outputs = []
    with Engine(config) as engine:
        if policy == "oracle":
            load_eviction_oracle(engine, future)
        for turn in range(NUM_TURNS):
            requests = []
            for user in range(NUM_USERS):
                history[user] = history[user] + messages[user][turn]
                requests.append(
                    GenerateRequest(
                        input_ids=history[user],
                        # greedy: the graph policy admits in another order, and sampling
                        # from the engine's generator would follow that order
                        sampling=SamplingParams(
                            max_new_tokens=REPLY_LEN, ignore_eos=True, temperature=0
                        ),
                        hints=GraphHints(
                            program_id=f"user-{user}", continuation=turn < NUM_TURNS - 1
                        ),
                    )
                )
            results = [h.result() for h in engine.submit_many(requests)]
            engine.check_integrity()
            for user, result in enumerate(results):
                assert result.finish_reason == "length", result.error
                history[user] = history[user] + list(result.output_ids)
            outputs.append([list(r.output_ids) for r in results])
        return outputs, engine.stats(), cache_trace(engine)


@pytest.fixture(scope="module")
def lru_run():
    return run_rounds("lru")


@pytest.mark.parametrize("policy", ["slru", "lfu", "graph", "oracle"])
def test_outputs_identical_across_policies(lru_run, policy):
    lru_outputs, lru_stats, lru_trace = lru_run
    assert lru_stats["evicted_tokens_total"] > 0  # the pool is too small: eviction happened
    outputs, stats, _ = run_rounds(policy, lru_trace)
    assert outputs == lru_outputs
    total = stats["prefill_tokens_total"] + stats["cached_tokens_total"]
    assert total == lru_stats["prefill_tokens_total"] + lru_stats["cached_tokens_total"]
    if policy in ("graph", "oracle"):  # knowing the future beats recency on cyclic reuse
        assert stats["prefill_tokens_total"] < lru_stats["prefill_tokens_total"]


def test_oracle_needs_its_policy():
    with Engine(EngineConfig(model="random:tiny", max_kv_tokens=64)) as engine:
        with pytest.raises(InvalidRequestError, match="eviction_policy='oracle'"):
            load_eviction_oracle(engine, [])


def _kept_after_pressure(declared_a_s: float | None) -> tuple[int, int]:
    """Conversations A then B pause (A first); a request with no future then needs room for a
    part of one of them. Returns how many tokens of A's and of B's next turn were cached."""
    rng = random.Random(1)
    a, b, c = ([rng.randrange(3, 500) for _ in range(n)] for n in (100, 100, 150))
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(model="random:tiny", max_kv_tokens=300, eviction_policy="graph")
    with Engine(config) as engine:
        replies = []
        for prompt, after_s in ((a, declared_a_s), (b, None)):
            hints = GraphHints(continuation=True, next_turn_after_s=after_s)
            request = GenerateRequest(input_ids=prompt, sampling=sampling, hints=hints)
            replies.append(list(engine.generate([request])[0].output_ids))
        engine.generate([GenerateRequest(input_ids=c, sampling=sampling)])
        assert engine.stats()["evicted_tokens_total"] > 0
        cached = []
        for prompt, reply in zip((a, b), replies, strict=True):
            follow_up = GenerateRequest(input_ids=prompt + reply + [7] * 4, sampling=sampling)
            cached.append(engine.generate([follow_up])[0].cached_tokens)
            engine.check_integrity()
        return cached[0], cached[1]


def test_a_declared_return_time_decides_which_paused_branch_is_kept():
    """Without hints the branch that paused first is expected back first and stays whole; when
    it declares that it returns in an hour, the other one stays whole instead. Either way only
    the tail eviction needs is taken from the victim."""
    whole = 100 + 8 - 1  # prompt + reply; the last reply token was sampled, never computed
    a_kept, b_trimmed = _kept_after_pressure(None)
    assert a_kept == whole and 0 < b_trimmed < whole
    a_trimmed, b_kept = _kept_after_pressure(3600.0)
    assert b_kept == whole and 0 < a_trimmed < whole
