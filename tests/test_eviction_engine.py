"""Eviction policies in the engine: on multi-turn conversations that need about three times the
KV pool (cyclic reuse), every policy, the oracle driven by a recorded run included, produces the
same outputs (eviction never changes results), the invariants hold after every round, and the
oracle and the graph policy compute less prefill than LRU."""

from __future__ import annotations

import random

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
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
        model="random:tiny", max_kv_tokens=POOL_TOKENS, eviction_policy=policy, record_trace=True
    )
    messages = conversations()
    history = [[] for _ in range(NUM_USERS)]
    outputs = []
    with Engine(config) as engine:
        if policy == "oracle":
            engine.load_eviction_oracle(future)
        for turn in range(NUM_TURNS):
            requests = []
            for user in range(NUM_USERS):
                history[user] = history[user] + messages[user][turn]
                requests.append(
                    GenerateRequest(
                        input_ids=history[user],
                        sampling=SamplingParams(max_new_tokens=REPLY_LEN, ignore_eos=True),
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
        return outputs, engine.stats(), engine.cache_trace()


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
            engine.load_eviction_oracle([])
