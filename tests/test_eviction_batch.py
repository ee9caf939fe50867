"""Graph eviction on a plain run_batch of multi-turn conversations that each open with a private
context, on pools that hold only part of the batch (the cyclic case): on generated batches the
graph policy computes no more than 1.05x the offline optimum (Belady on the lru run's access
order) and never more than lru, outputs are identical across policies, and the scheduler's
invariants hold after every step. Plus the pieces: wanted marks, their grace, the hint."""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from flowlang import assistant, gen, program, system, user
from flowlang.backends.local import LocalBackend
from runtime.cache.allocator import SlotAllocator
from runtime.cache.graph_policy import CONTINUATION_GRACE_S, GraphMarks
from runtime.cache.radix import RadixCache
from runtime.cache.replay import replay, working_set
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.engine_tools import cache_trace
from runtime.protocol import GraphHints
from runtime.scheduler.lookahead import WorkAhead

SAMPLING = {"ignore_eos": True, "temperature": 0.0}


@program
def document_chat(s, context, questions, system_prompt="", reply_tokens=6):
    if system_prompt:
        s += system(system_prompt)
    for turn, question in enumerate(questions):
        s += user(f"{context}\n\n{question}" if turn == 0 else question)
        s += assistant(gen(f"answer_{turn}", max_new_tokens=reply_tokens))


def make_batch(seed: int, num_convs: int, context_words: int, num_turns: int, shared: bool):
    rng = random.Random(seed)
    words = "alpha beta gamma delta kettle lamp shipping refund order week".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(n))

    system_prompt = "Answer from the document. " + text(40) if shared else ""
    return [
        {
            "context": text(context_words),
            "questions": tuple(f"Question {t}: {text(6)}?" for t in range(num_turns)),
            "system_prompt": system_prompt,
        }
        for _ in range(num_convs)
    ]


def run(model_dir, batch, capacity: int, policy: str, page_size: int = 1):
    config = EngineConfig(
        model=str(model_dir),
        max_kv_tokens=capacity,
        eviction_policy=policy,
        page_size=page_size,
        record_trace=True,
        attention_backend="torch",
    )
    with Engine(config) as engine:
        scheduler = engine.scheduler
        process = scheduler.process

        def checked(batch_, outcomes):  # on the loop thread, after every step
            process(batch_, outcomes)
            scheduler.check_integrity()

        scheduler.process = checked
        states = document_chat.run_batch(
            batch, backend=LocalBackend(engine), progress=False, sampling=SAMPLING
        )
        assert all(hasattr(s, "text") for s in states), states
        engine.check_integrity()
        return [s.token_ids() for s in states], engine.stats(), cache_trace(engine)


# (seed, conversations, context words, turns, shared system prompt, pool share, page size)
CELLS = [
    (0, 8, 120, 3, False, 0.3, 1),
    (1, 10, 80, 4, True, 0.45, 1),
    (2, 6, 200, 3, False, 0.6, 16),
    (3, 12, 60, 3, True, 0.25, 16),
]


@pytest.mark.parametrize("cell", CELLS, ids=[f"cell{c[0]}" for c in CELLS])
def test_graph_meets_the_offline_optimum_on_cyclic_run_batch(tiny_model_dir, cell):
    seed, num_convs, context_words, num_turns, shared, share, page_size = cell
    batch = make_batch(seed, num_convs, context_words, num_turns, shared)
    unbounded_ids, _, unbounded_trace = run(tiny_model_dir, batch, 200_000, "lru")
    capacity = int(working_set(unbounded_trace) * share) // page_size * page_size
    lru_ids, lru, lru_trace = run(tiny_model_dir, batch, capacity, "lru", page_size)
    graph_ids, graph, _ = run(tiny_model_dir, batch, capacity, "graph", page_size)
    assert lru_ids == graph_ids == unbounded_ids  # eviction never changes results
    assert lru["evicted_tokens_total"] > 0  # the pool was short: this is the cyclic case
    optimum = replay(lru_trace, capacity, "oracle").computed_tokens
    assert graph["prefill_tokens_total"] <= 1.05 * optimum
    assert graph["prefill_tokens_total"] <= lru["prefill_tokens_total"]
    # new conversations waited for those in flight: at the program gate (programs.py) or, for
    # a request of a program already in, behind the work ahead (lookahead.py)
    assert graph["program_entries_deferred_total"] + graph["admissions_held_total"] > 0


def test_patience_zero_holds_nothing_back(tiny_model_dir):
    batch = make_batch(0, 8, 120, 3, False)
    _, _, trace = run(tiny_model_dir, batch, 200_000, "lru")
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_kv_tokens=int(working_set(trace) * 0.3),
        eviction_policy="graph",
        admission_patience=0,
    )
    with Engine(config) as engine:
        document_chat.run_batch(batch, backend=LocalBackend(engine), progress=False)
        assert engine.stats()["admissions_held_total"] == 0


def _paused(cache: RadixCache, marks: GraphMarks, ids, return_s: float, immediate: bool):
    done = cache.insert(ids, cache.allocator.alloc(len(ids)))
    cache.lock(done.position)
    cache.unlock(done.position)
    marks.mark_continuation(done.position, return_s, immediate)
    cache.check_integrity()
    return done.position


def test_a_branch_back_right_away_is_wanted_until_read_or_overdue():
    cache = RadixCache(SlotAllocator(64), 1, "graph")
    marks = GraphMarks(cache)
    _paused(cache, marks, [1, 2, 3], 10.0, immediate=False)  # declared: not wanted
    assert cache.wanted_size == 0
    position = _paused(cache, marks, [1, 2, 7, 8], 10.0, immediate=True)
    assert cache.wanted_size == 4  # its path, the shared head included
    marks.advance(10.0 + CONTINUATION_GRACE_S / 2)
    assert cache.wanted_size == 4
    cache.lock(position)  # its next turn was admitted: the mark is used up
    marks.mark_read(position)
    cache.unlock(position)
    assert cache.wanted_size == 0
    _paused(cache, marks, [4, 5], 20.0, immediate=True)
    assert cache.wanted_size == 2
    marks.advance(20.0 + CONTINUATION_GRACE_S + 1)  # it never came back: forgotten
    assert cache.wanted_size == 0
    cache.check_integrity()
    assert cache.evict(cache.evictable_size) > 0  # and evicted like any other


def test_the_hints_say_what_a_conversation_still_adds(tiny_model_dir):
    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)) as engine:
        backend = LocalBackend(engine, record=True)
        document_chat.run(
            context="a short document",
            questions=("first?", "second?", "third?"),
            backend=backend,
            sampling=SAMPLING,
        )
        hints = [request.hints for request, _ in backend.generations]
    assert [h.continuation for h in hints] == [True, True, False]
    first, second, last = (h.future_tokens for h in hints)
    assert last is None
    assert first > second > 2 * 6  # two more replies of 6 tokens, and their questions
    assert first - second == pytest.approx(second, abs=4)  # turns of about equal size


class _Lookahead:
    """What WorkAhead reads of the lookahead: the pool's size and the hinted work ahead."""

    def __init__(self, num_slots: int, ahead: dict) -> None:
        self.kv = SimpleNamespace(allocator=SimpleNamespace(num_slots=num_slots))
        self._ahead = Counter(ahead)

    def tokens_ahead(self, running) -> Counter:
        return Counter(self._ahead)


def _request(namespace: str, num_tokens: int, future: int = 0) -> SimpleNamespace:
    hints = GraphHints(program_id="p", continuation=True, future_tokens=future)
    return SimpleNamespace(namespace=namespace, num_tokens=num_tokens, hints=hints)


def test_an_owners_own_work_ahead_counts_whole_and_anothers_only_within_its_share():
    """A run_batch is one owner: its running conversations' later turns (hinted) hold its new
    ones back even beyond what the pool has left beside them (capped there, the 48 x 3 batch
    at 35% computed 28,880 tokens instead of 23,416); another owner's hints count only up to
    its share of the pool less what it holds, so they never hold this owner's requests."""
    running = [_request("ka", 700)]
    ahead = WorkAhead(_Lookahead(1_000, {"ka": 900}), running)
    assert ahead.future_tokens(_request("ka/s", 50, future=100)) == 900 + 100
    # kb's share is 500 of the 1,000 slots; ka holds 700 of them: none of ka's hints count
    assert ahead.future_tokens(_request("kb", 50, future=40)) == 40
    ahead.admitted(_request("kb", 300, future=60))  # kb holds 300 now, hints 60
    assert ahead.future_tokens(_request("ka", 10)) == 900 + 60
    assert ahead.future_tokens(_request("kb", 10, future=5)) == 60 + 5
