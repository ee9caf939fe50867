"""Hostile testing, fourth round (issue 50): stop_regex over jump-forward text is bounded per
engine step (#3), and a streamed n > 1 answer interleaves its choices.

#3: a grammar forces thousands of characters in one step and a stop_regex such as
`.{0,1020}Q` costs ~2,500 automaton steps a character: the engine's thread spent seconds in
one step while every other tenant waited. Matching now takes a bounded number of automaton
steps per request and step; the request samples nothing until it caught up, so what it
returns is what unbounded matching returns.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_stop_regex import PATTERNS as BASE_PATTERNS

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.generation import GenerationState, StopBudget
from runtime.protocol import Constraint, GenerateRequest, SamplingParams
from runtime.stop_regex import StopRegexMatcher

HEAVY = r".{0,1020}Q"  # ~2,000 automaton states: each character advances ~1,000 threads
PATTERNS = [*BASE_PATTERNS, r".{0,12}Q", r"(?:.|\n){2,9}d\b"]  # and bounded repeats
ALPHABET = "aabbcdxyQE1.-\n end"


def leftmost_non_empty(pattern: str, text: str) -> tuple[int, int] | None:
    """re's first non-empty match in `text` (as searching again after an empty one finds)."""
    pos = 0
    while pos <= len(text) and (match := re.compile(pattern).search(text, pos)):
        if match.end() > match.start():
            return match.span()
        pos = match.start() + 1
    return None


# ---------------------------------------------------------------- the matcher, piece by piece
@given(
    pattern=st.sampled_from(PATTERNS),
    text=st.text(alphabet=ALPHABET, max_size=24),
    cuts=st.lists(st.integers(1, 24), max_size=6),
    budgets=st.lists(st.integers(0, 40), min_size=1, max_size=8),
)
@settings(max_examples=300, deadline=None)
def test_a_piece_read_within_budgets_finds_what_re_finds(pattern, text, cuts, budgets):
    """Pieces read a few steps at a time find re's leftmost non-empty match of the text up to
    the piece where it appears (what one unbounded feed finds), and no call goes past its
    budget by more than one character's steps and the end's."""
    matcher, whole, fed, found, calls = (
        StopRegexMatcher(pattern),
        StopRegexMatcher(pattern),
        0,
        None,
        0,
    )
    bound = 3 * len(matcher.prog) + 1
    for end in sorted({*(c for c in cuts if c < len(text)), len(text)}):
        matcher.begin(text[fed:end])
        while True:
            budget = budgets[calls % len(budgets)]
            before = matcher.num_steps
            done = matcher.advance(budget)
            assert matcher.num_steps - before <= budget + bound
            calls += 1
            if done:
                break
            assert calls < 100_000  # every call with a budget reads a character at least
            budgets = [b or 1 for b in budgets] if calls % len(budgets) == 0 else budgets
        found = matcher.found
        assert found == whole.feed(text[fed:end])
        assert matcher.search_from == whole.search_from
        fed = end
        if found is not None:
            break
    assert found == leftmost_non_empty(pattern, text[:fed])


# ---------------------------------------------------------------- GenerationState, step by step
def run(tokenizer, ids, params, budget, per_step):
    """Tokens appended `per_step` at a time (a sampled one and those a grammar forces after
    it), as the engine does: with a `budget` each step (None: unbounded), a request whose
    stop matching is behind only catches up. The state, what streamed, the most automaton
    steps in one step, and the number of steps."""
    gen = GenerationState(
        SamplingParams(max_new_tokens=10_000, **params), [1], tokenizer, [2], 49152
    )
    streamed, most, steps, i = "", 0, 0, 0
    while not gen.finished:
        steps += 1
        before = gen._regex_stops.num_steps
        if budget is not None:
            gen.new_step(StopBudget(budget))
        if gen.checking_stops:
            gen.catch_up()
        elif i < len(ids):
            for token_id in ids[i : i + per_step]:
                gen.append(token_id)
                if gen.finished:
                    break
            i += per_step
        else:
            gen.finish("length")
        most = max(most, gen._regex_stops.num_steps - before)
        streamed += gen.stream_delta()
    return gen, streamed + gen.stream_delta(), most, steps


@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3),
    text=st.text(alphabet=ALPHABET, min_size=1, max_size=40),
    per_step=st.integers(1, 12),
    budget=st.integers(1, 60),
    stop=st.sampled_from([[], ["d "], ["Qa", "1."]]),
    min_new_tokens=st.integers(0, 3),
)
@settings(max_examples=200, deadline=None)
def test_bounded_matching_returns_what_unbounded_matching_returns(
    default_tokenizer, patterns, text, per_step, budget, stop, min_new_tokens
):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    params = dict(stop_regex=patterns, stop=stop, min_new_tokens=min_new_tokens)
    free, free_streamed, _, _ = run(default_tokenizer, ids, params, None, per_step)
    gen, streamed, most, _ = run(default_tokenizer, ids, params, budget, per_step)
    assert (gen.text, gen.finish_reason, gen.matched_stop) == (
        free.text,
        free.finish_reason,
        free.matched_stop,
    )
    assert gen.output_ids == free.output_ids and streamed == free_streamed == gen.text
    num_states = sum(len(m.prog) for m in gen._regex_stops.matchers)
    assert most <= budget + 3 * num_states + 1


def test_a_long_forced_text_is_matched_a_bounded_amount_a_step(default_tokenizer):
    forced = "x" * 1100 + "Q" + "y b" * 50
    ids = default_tokenizer.encode(forced, add_special_tokens=False)
    params = dict(stop_regex=[HEAVY])
    free, _, unbounded_most, _ = run(default_tokenizer, ids, params, None, len(ids))
    gen, streamed, most, steps = run(default_tokenizer, ids, params, 8192, len(ids))
    assert gen.text == free.text == streamed == forced[: re.search(HEAVY, forced).start()]
    assert gen.output_ids == free.output_ids and gen.matched_stop == HEAVY
    assert unbounded_most > 1_000_000  # what the engine's thread did in one step before
    assert most <= 8192 + 3 * 2048 + 1 and steps > 100


# ---------------------------------------------------------------- through the engine
def matching_per_step(engine, monkeypatch) -> list[int]:
    """Automaton steps of every stop_regex matcher in each engine step (filled as it runs)."""
    matchers: list[StopRegexMatcher] = []
    init = StopRegexMatcher.__init__

    def registered(self, *args, **kwargs):
        init(self, *args, **kwargs)
        matchers.append(self)

    monkeypatch.setattr(StopRegexMatcher, "__init__", registered)
    per_step: list[int] = []
    step = engine._loop._step

    def counted():
        before = sum(m.num_steps for m in matchers)
        try:
            return step()
        finally:
            per_step.append(sum(m.num_steps for m in matchers) - before)

    engine._loop._step = counted
    return per_step


def forced_past_heavy_stops(model_dir, monkeypatch, forced: str, num_requests: int, **sampling):
    """`num_requests` requests whose grammar forces `forced`, with the heavy stop_regex, in
    one engine: each stops where re finds the match, all the matching happened (a million
    automaton steps a request at least), and no engine step did more than one budget of it
    (and one character's steps), all requests together."""
    engine = Engine(EngineConfig(model=str(model_dir), max_kv_tokens=16384))
    per_step = matching_per_step(engine, monkeypatch)
    requests = [
        GenerateRequest(
            sampling=SamplingParams(temperature=1, seed=i, stop_regex=[HEAVY], **sampling),
            constraint=Constraint(grammar=f'root ::= "{forced}" [a-z]'),
            text="Hi",
        )
        for i in range(num_requests)
    ]
    try:
        results = [h.result() for h in engine.submit_many(requests)]
    finally:
        engine.close()
    expected = forced[: re.search(HEAVY, forced).start()]
    assert all(r.text == expected and r.finish_reason == "stop" for r in results), results
    assert sum(per_step) > num_requests * 1_000_000
    assert max(per_step) <= 8192 + 3 * 2048 + 1, max(per_step)


def test_n_copies_of_a_heavy_request_share_one_budget_a_step(tiny_model_dir, monkeypatch):
    """n=4 requests forcing 1,400 characters past the heavy stop_regex (the benchmark's
    attack): one engine step's matching, all requests together, is one budget; before, each
    request had its own, 4 budgets a step."""
    forced = "ab" * 600 + "Q" + "cd" * 100
    forced_past_heavy_stops(tiny_model_dir, monkeypatch, forced, 4, max_new_tokens=3000)


def test_jump_forward_text_never_holds_the_engine_thread(tiny_model_dir, monkeypatch):
    """Two requests whose grammar forces 1,200 characters, with the heavy stop_regex: no
    engine step does more than a bounded amount of matching (before: millions of automaton
    steps, seconds, in one step)."""
    forced = "x" * 1100 + "Q" + "y b" * 30
    forced_past_heavy_stops(tiny_model_dir, monkeypatch, forced, 2, max_new_tokens=2000)


def tokens_per_step(monkeypatch) -> list[int]:
    """The tokens each engine step computes (filled as engines run)."""
    from runtime.scheduler.scheduler import Scheduler

    per_step: list[int] = []
    schedule = Scheduler.schedule

    def counted(self):
        batch = schedule(self)
        if batch is not None:
            per_step.append(sum(e.num_new + len(e.draft) for e in batch.entries))
        return batch

    monkeypatch.setattr(Scheduler, "schedule", counted)
    return per_step


def forced_run(model_dir, monkeypatch, chunk_tokens: int) -> tuple[list, list[int], list[int]]:
    """Two requests whose grammar forces 1,500 characters (jump-forward): their results, the
    tokens each engine step computed and the tokens each jump-forward appended."""
    from runtime.generation import GenerationState

    forced = "The quick brown fox jumps over the lazy dog. " * 33
    requests = [
        GenerateRequest(
            text="Say",
            sampling=SamplingParams(max_new_tokens=2000, temperature=1, seed=i),
            constraint=Constraint(grammar=f'root ::= "{forced}" [a-z]'),
        )
        for i in range(2)
    ]
    config = EngineConfig(
        model=str(model_dir), max_kv_tokens=8192, chunked_prefill_tokens=chunk_tokens
    )
    with monkeypatch.context() as patch:  # this run's counts only
        per_step = tokens_per_step(patch)
        per_jump: list[int] = []
        jump_forward = GenerationState.jump_forward

        def counted(self, max_tokens: int) -> int:
            per_jump.append(jump_forward(self, max_tokens))
            return per_jump[-1]

        patch.setattr(GenerationState, "jump_forward", counted)
        with Engine(config) as engine:
            results = engine.generate(requests)
    return results, per_step, per_jump


def test_forced_tokens_are_computed_in_chunks_with_the_same_output(tiny_model_dir, monkeypatch):
    """A jump-forward's hundreds of forced tokens are appended and go through the forward in
    chunks of the step's prefill budget, as a prompt does (before: all appended in one step,
    grammar and stop checks of thousands of tokens at once, and computed in one pass, which
    held every other request's step for seconds on the default model), and the output is what
    one pass gives: sampled at temperature 1, as a forced token is taken, not drawn."""
    whole, whole_steps, whole_jumps = forced_run(tiny_model_dir, monkeypatch, 4096)
    chunked, chunked_steps, chunked_jumps = forced_run(tiny_model_dir, monkeypatch, 64)
    assert max(whole_steps) > 300 and max(whole_jumps) > 300  # the forced string at once
    assert max(chunked_steps) <= 64 + 2, chunked_steps  # a chunk, plus the other's token
    assert max(chunked_jumps) <= 64 and len(chunked_jumps) > 10, chunked_jumps
    for a, b in zip(whole, chunked, strict=True):
        assert (a.output_ids, a.text, a.finish_reason) == (b.output_ids, b.text, b.finish_reason)


# ---------------------------------------------------------------- n > 1 streams interleave
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from conftest import ServerThread

    thread = ServerThread(Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)))
    yield thread
    thread.stop()


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", {"prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}]}),
    ],
)
def test_a_streamed_n_2_answer_interleaves_its_choices(server, route, body):
    body = {
        **body,
        "model": server.engine.config.model,
        "n": 2,
        "max_tokens": 24,
        "temperature": 1,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=server.url, timeout=120) as client:
        response = client.post(route, json=body)
    assert response.status_code == 200, response.text
    frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(f) for f in frames[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 48
    order = [c["choices"][0]["index"] for c in chunks[:-1]]
    finished = [c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1] and order.count(0) > 3 and order.count(1) > 3
    # side by side: choice 1 begins long before choice 0 ends (before: 0 0 0 ... 1 1 1)
    assert order.index(1) < len(order) - 1 - order[::-1].index(0) - 3, order


def test_another_owners_request_that_fits_passes_one_that_does_not(tiny_model_dir, step_counter):
    """One owner's long requests fill the pool, its next ones wait for room; another owner's
    1-token request that fits starts at once instead of waiting behind them (before: the
    first waiting request that did not fit stopped admission for everyone). The same owner's
    requests still start in order."""
    long_run = SamplingParams(max_new_tokens=600, ignore_eos=True, temperature=0)
    hogs = [
        GenerateRequest(input_ids=list(range(100 + i, 400 + i)), sampling=long_run, namespace="a")
        for i in range(3)
    ]
    other = GenerateRequest(
        input_ids=[9, 8, 7, 6],
        sampling=SamplingParams(max_new_tokens=1, temperature=0),
        namespace="b/salt",
    )
    config = EngineConfig(model=str(tiny_model_dir), max_kv_tokens=1024)
    with Engine(config) as engine:
        handles = engine.submit_many(hogs)
        next(iter(handles[0].chunks()))  # the first is running; the others wait for room
        start = step_counter.now()
        result = engine.submit(other).result(timeout=120)
        took = step_counter.now() - start
        waiting = engine._call_in_loop(lambda: sorted(engine.scheduler.waiting))
        for handle in handles:
            handle.cancel()
    assert result.finish_reason == "length"
    assert took <= 5, f"the other owner waited {took} steps behind requests that did not fit"
    assert waiting == sorted(h.rid for h in handles[1:])  # a's later ones: not started early


def hog_and_other(model_dir, step_counter, other_namespace: str):
    """Owner "a"'s 900-token request (100 new tokens) holds all but ~50 slots of a 1,024-slot
    pool; a 60-token request in `other_namespace` arrives once it runs. The steps the other
    request took, both outputs, and the share retractions counted."""
    hog = GenerateRequest(
        input_ids=[(7 * i) % 250 + 3 for i in range(900)],
        sampling=SamplingParams(max_new_tokens=100, ignore_eos=True, temperature=0),
        namespace="a",
    )
    other = GenerateRequest(
        input_ids=list(range(40, 100)),
        sampling=SamplingParams(max_new_tokens=1, temperature=0),
        namespace=other_namespace,
    )
    config = EngineConfig(model=str(model_dir), max_kv_tokens=1024, chunked_prefill_tokens=512)
    with Engine(config) as engine:
        handle = engine.submit(hog)
        next(iter(handle.chunks()))  # it runs, its whole prompt computed
        start = step_counter.now()
        result = engine.submit(other).result(timeout=120)
        took = step_counter.now() - start
        hog_result = handle.result(timeout=300)
        engine.scheduler.check_integrity()
        retracted = engine.stats()["share_retractions_total"]
    return took, result, hog_result, retracted


def test_an_owner_over_its_share_of_the_pool_makes_room_for_another(tiny_model_dir, step_counter):
    """#3's last piece: one owner's running request holds the pool (as the attack's n copies
    of a 4,000-token answer did while their stop matching caught up); another owner's request
    that does not fit starts within a few steps: the hog, over its half of the pool, is
    retracted (its KV kept in the tree) and comes back with the same output. Before, the other
    owner waited for the hog to end. With one owner nothing is retracted."""
    took, result, hog, retracted = hog_and_other(tiny_model_dir, step_counter, "b")
    assert result.finish_reason == "length" and retracted >= 1
    assert took <= 5, f"the other owner waited {took} steps behind the hog"
    alone_took, alone, alone_hog, alone_retracted = hog_and_other(
        tiny_model_dir, step_counter, "a/salt"
    )
    assert alone_retracted == 0 and alone_took > 50  # the same owner: it waits its turn
    assert hog.output_ids == alone_hog.output_ids and len(hog.output_ids) == 100
    assert result.output_ids == alone.output_ids


def prefill_per_step(model_dir, monkeypatch, other_namespace: str) -> list[int]:
    """Owner "a"'s 900-token prompt beside a decoding request in `other_namespace`: the
    tokens each engine step computed, on a machine where a step costs 40 ms plus 2 ms a token
    (each step's measured time replaced by that)."""
    from runtime.scheduler.step_time import StepTime

    per_step = tokens_per_step(monkeypatch)
    observe = StepTime.observe
    monkeypatch.setattr(
        StepTime, "observe", lambda self, tokens, _s: observe(self, tokens, 0.040 + 0.002 * tokens)
    )
    decoding = GenerateRequest(
        input_ids=[5, 6, 7],
        sampling=SamplingParams(max_new_tokens=30, ignore_eos=True, temperature=0),
        namespace=other_namespace,
    )
    long_prompt = GenerateRequest(
        input_ids=[(3 * i) % 250 + 3 for i in range(900)],
        sampling=SamplingParams(max_new_tokens=1, temperature=0),
        namespace="a",
    )
    config = EngineConfig(
        model=str(model_dir), max_kv_tokens=4096, chunked_prefill_tokens=512, shared_step_ms=80
    )
    with Engine(config) as engine:
        handle = engine.submit(decoding)
        next(iter(handle.chunks()))  # it decodes
        engine.submit(long_prompt).result(timeout=120)
        handle.result(timeout=120)
    return per_step


def test_another_owners_long_prompt_is_computed_in_short_steps(tiny_model_dir, monkeypatch):
    """#3 and #8's last piece: while another owner has work, a step computes what fits in
    shared_step_ms (80 ms) by the measured step cost (here 40 ms + 2 ms a token: 20 tokens),
    so one tenant's long prompt or forced text delays another's next token by a short step
    (before: chunked_prefill_tokens, ~1.5 s on 2 cores for 1,024 tokens of the default model).
    The first steps, before the cost is known, take 64. One owner alone keeps long chunks."""
    shared = prefill_per_step(tiny_model_dir, monkeypatch, "b")
    assert max(shared) <= 64 + 1, shared  # a chunk, plus the other's token
    chunks = [n for n in shared if n > 3]  # (the decoding request's prompt: 3 tokens)
    learned = next(i for i, n in enumerate(chunks) if n <= 20 + 1)  # once steps taught the cost
    measured = chunks[learned:]
    assert learned <= 6 and len(measured) > 30, shared
    assert max(measured) <= 20 + 1 and min(measured[:-1]) >= 19, shared
    alone = prefill_per_step(tiny_model_dir, monkeypatch, "a/salt")
    assert max(alone) > 500, alone  # the same owner: full chunks
