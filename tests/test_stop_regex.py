"""Engine-level pieces of SGLang compatibility: stop_regex (cut exactly like stop strings,
never streamed), n samples of one prompt (prefilled once), and input logprobs with their top-k
(equal to a full forward of the reference model)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.engine import Engine, InvalidRequestError
from runtime.generation import GenerationState
from runtime.protocol import GenerateRequest, SamplingParams

TEXT = "Order 66 shipped on May 4. Refund: 12.50 USD, ref AB-77. Thanks!"


# patterns that exercise every construct the matcher compiles (also test_hostile_round4_stops)
PATTERNS = [
    r"ab+",
    r"a|ab",
    r"(a|ab)(c|bcd)",
    r"\d+\.\d+",
    r"x*y",
    r"\bend\b",
    r"a{2,3}?b",
    r"(?i)Ab",
    r"(a|b)*c",
    r"[^ab]+",
    r"\Bb",
    r"^a",
    r"(?m)^b",
    r"(?m)b$",
    r"(ab|a)(bc)?",
    r"a??b",
    r"(?:a|)+b",
    r"\w+\s",
    r"[a-c]{1,3}d?",
    r"(a|a)+b",
    r"b$",
    r"a$\n?",
    r"\Z|b",
]


def feed(tokenizer, text=TEXT, **params) -> tuple[GenerationState, str]:
    """Append `text`'s tokens one by one; the state and everything streamed meanwhile."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    params = {"max_new_tokens": 1000, **params}
    gen = GenerationState(SamplingParams(**params), [1], tokenizer, [2], 49152)
    streamed = ""
    for token_id in ids:
        gen.append(token_id)
        streamed += gen.stream_delta()
        if gen.finished:
            break
    else:
        gen.finish("length")
    return gen, streamed + gen.stream_delta()


# ---------------------------------------------------------------- stop_regex
@pytest.mark.parametrize(
    "patterns, text",
    [
        ([r"\d+\.\d+"], "Order 66 shipped on May 4. Refund: "),  # across tokens: "12", ".", "50"
        ([r"May \d"], "Order 66 shipped on "),
        ([r"[A-Z]{2}-\d+"], "Order 66 shipped on May 4. Refund: 12.50 USD, ref "),
        ([r"Thanks", r"USD"], "Order 66 shipped on May 4. Refund: 12.50 "),  # the earliest
        ([r"\d"], "Order "),  # a greedy pattern stops at its first possible match
    ],
)
def test_stop_regex_cuts_exactly_where_the_match_starts(default_tokenizer, patterns, text):
    gen, streamed = feed(default_tokenizer, stop_regex=patterns)
    assert gen.text == text == streamed  # the match never reaches the stream
    assert gen.finish_reason == "stop" and gen.matched_stop in patterns


def test_stop_regex_included_keeps_the_match(default_tokenizer):
    gen, streamed = feed(default_tokenizer, stop_regex=r"\d+\.\d+", include_stop_str_in_output=True)
    assert gen.text.endswith("Refund: 12.5") and gen.text == streamed
    # the match is "12.5": the text so far matched as soon as the "5" came (documented)


def test_stop_regex_and_stop_strings_the_earliest_wins(default_tokenizer):
    gen, _ = feed(default_tokenizer, stop=["Refund"], stop_regex=[r"\d\d\.\d"])
    assert gen.text == "Order 66 shipped on May 4. " and gen.matched_stop == "Refund"
    gen, _ = feed(default_tokenizer, stop=["Thanks"], stop_regex=[r"ref [A-Z]"])
    assert gen.text.endswith("USD, ") and gen.matched_stop == "ref [A-Z]"


def test_stop_regex_streams_what_can_no_longer_match(default_tokenizer):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    gen = GenerationState(
        SamplingParams(max_new_tokens=1000, stop_regex=[r"USD, ref [A-Z]+-\d+"]),
        [1],
        default_tokenizer,
        [2],
        49152,
    )
    streamed = ""
    for token_id in ids:
        gen.append(token_id)
        streamed += gen.stream_delta()
        if gen.finished:
            break
        # a partial match is held back, everything before it is out
        assert streamed == gen.text[: len(streamed)]
        if "USD" not in gen.text:
            assert len(gen.text) - len(streamed) <= 3
    assert gen.text == "Order 66 shipped on May 4. Refund: 12.50 " == streamed + gen.stream_delta()


def test_stop_regex_respects_min_new_tokens_and_ignores_empty_matches(default_tokenizer):
    gen, _ = feed(default_tokenizer, stop_regex=[r"\d"], min_new_tokens=6)
    assert gen.text.startswith("Order 66 shipped") and gen.matched_stop == r"\d"
    gen, streamed = feed(default_tokenizer, stop_regex=[r"x*", r"\b"])  # only empty matches
    assert gen.finish_reason == "length" and gen.text == TEXT == streamed


@pytest.mark.parametrize(
    "value, message",
    [
        ("(a", "invalid stop_regex"),
        (r"\p{L}", "invalid stop_regex"),  # the regex module's syntax: not re's
        ("", "1 to 256 bytes"),
        (["a"] * 33, "at most 32"),
    ],
)
def test_bad_stop_regex_is_refused(value, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(")):
        SamplingParams(stop_regex=value)


# ---------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)) as eng:
        yield eng


def test_stop_regex_through_the_engine(engine):
    ids = engine.tokenizer.encode("Count: one two three")
    (free,) = engine.generate(
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True),
        )
    )
    pattern = r"[aeiou]"  # the tiny model writes words: it will write a vowel
    assert any(c in "aeiou" for c in free.text)
    (cut,) = engine.generate(
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(
                temperature=0, max_new_tokens=24, ignore_eos=True, stop_regex=pattern
            ),
        )
    )
    assert cut.finish_reason == "stop" and cut.matched_stop == pattern
    assert free.text.startswith(cut.text) and not any(c in "aeiou" for c in cut.text)
    assert cut.output_ids == free.output_ids[: len(cut.output_ids)]


def test_stop_regex_needs_a_tokenizer():
    with Engine(EngineConfig(model="random:tiny", max_kv_tokens=1024)) as eng:
        request = GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(stop_regex="x"))
        with pytest.raises(InvalidRequestError, match="no tokenizer"):
            eng.submit(request)


def test_n_samples_share_one_prefill(engine):
    ids = list(range(300, 420))
    before = engine.stats()["prefill_tokens_total"]
    samples = [
        GenerateRequest(input_ids=ids, sampling=SamplingParams(seed=7 + i, max_new_tokens=8))
        for i in range(4)
    ]
    results = engine.generate(samples)
    # computed once: the other samples draw from the logits kept after the prompt
    assert engine.stats()["prefill_tokens_total"] - before == len(ids)
    assert len({tuple(r.output_ids) for r in results}) > 1  # seeds differ: samples differ
    assert all(r.prompt_tokens == len(ids) for r in results)


def test_input_logprobs_and_top_k_equal_a_full_forward(engine, tiny_model_dir):
    import transformers

    ids = engine.tokenizer.encode("The parcel left the depot on Monday morning.")
    params = SamplingParams(
        max_new_tokens=0, prompt_logprobs=True, logprob_start_len=2, top_logprobs=3
    )
    (result,) = engine.generate(GenerateRequest(input_ids=ids, sampling=params))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert (
        result.prompt_logprobs[:2] == [None, None] and result.prompt_top_logprobs[:2] == [None] * 2
    )
    for j in range(2, len(ids)):
        expected = logprobs[j - 1]
        assert result.prompt_logprobs[j] == pytest.approx(float(expected[ids[j]]), abs=1e-3)
        values, indices = expected.topk(3)
        top_ids, top_values = zip(*result.prompt_top_logprobs[j], strict=True)
        assert list(top_ids) == indices.tolist()
        assert list(top_values) == pytest.approx(values.tolist(), abs=1e-3)


# ---------------------------------------------------------------- linear time
PATHOLOGICAL = r"(a|a)+b"  # backtracking engines take 2^n steps over n "a"s


def test_a_pathological_stop_regex_costs_steps_linear_in_the_text(default_tokenizer):
    (a_id,) = default_tokenizer.encode("a", add_special_tokens=False)

    def steps_for(num_tokens: int) -> tuple[int, GenerationState]:
        params = SamplingParams(max_new_tokens=num_tokens + 1, stop_regex=[PATHOLOGICAL, r"\d+"])
        gen = GenerationState(params, [1], default_tokenizer, [2], 49152)
        for _ in range(num_tokens):
            gen.append(a_id)
        return gen._regex_stops.num_steps, gen

    steps, gen = steps_for(2000)
    assert not gen.finished and gen.text == "a" * 2000
    num_states = sum(len(m.prog) for m in gen._regex_stops.matchers)
    assert steps <= 2 * num_states * len(gen.text)  # each character advances each thread once
    double, _ = steps_for(4000)
    assert double <= 2 * steps + 100  # twice the text, twice the work: never rescanned
    assert gen.stream_delta() == ""  # a match could still begin at the first "a": held back


@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(a)\1", "a backreference"),
        (r"a(?=b)", "a lookahead or lookbehind"),
        (r"(?<!x)a", "a negative lookahead or lookbehind"),
        (r"(?>a+)b", "an atomic group"),
        (r"a++b", "a possessive repeat"),
        (r"(a)?(?(1)b|c)", "a conditional group"),
        (r"(?:a{100}){100}", "needs more automaton states"),
    ],
)
def test_a_stop_regex_that_is_not_linear_is_refused_naming_it(engine, pattern, message):
    request = GenerateRequest(text="Hi", sampling=SamplingParams(stop_regex=[pattern]))
    with pytest.raises(InvalidRequestError, match=message) as refused:
        engine.submit(request)
    assert repr(pattern) in str(refused.value)


def test_the_automaton_states_of_all_patterns_are_capped_together(engine):
    patterns = ["(?:ab){300}"] * 4  # 600 states each
    request = GenerateRequest(text="Hi", sampling=SamplingParams(stop_regex=patterns))
    with pytest.raises(InvalidRequestError, match=r"has left \(245 of 2,048"):
        engine.submit(request)


@given(
    pattern=st.sampled_from(PATTERNS),
    text=st.text(alphabet="aabbcdxyE1.-\n end", max_size=16),
    cuts=st.lists(st.integers(1, 16), max_size=6),
)
@settings(max_examples=400, deadline=None)
def test_the_automaton_finds_what_re_finds_in_the_text_so_far(pattern, text, cuts):
    """Fed in any pieces, the first match is re's leftmost non-empty match of the text up to
    the piece where it appeared."""
    import re

    import regex

    from runtime.stop_regex import StopRegexMatcher

    def leftmost_non_empty(upto: str):
        pos = 0
        while pos <= len(upto) and (match := re.compile(pattern).search(upto, pos)):
            if match.end() > match.start():
                return match.span()
            pos = match.start() + 1
        return None

    matcher, fed, found = StopRegexMatcher(pattern), 0, None
    for end in sorted({*(c for c in cuts if c < len(text)), len(text)}):
        found = matcher.feed(text[fed:end])
        fed = end
        if found is not None:
            break
    assert found == leftmost_non_empty(text[:fed])
    if found is None:  # held back from the stream: from where a match could still begin
        # (laziness changes which match is found, never whether one can still begin; the
        # regex module's partial matching misjudges lazy counted repeats: a{2,3}?b in "aa1")
        greedy = pattern.replace("{2,3}?", "{2,3}").replace("??", "?")
        partial = regex.compile(greedy).search(text, partial=True)
        assert matcher.search_from == (partial.start() if partial else len(text))


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from conftest import ServerThread

    thread = ServerThread(Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)))
    yield thread
    thread.stop()


def test_a_pathological_stop_regex_never_slows_another_request(server):
    import json
    import threading
    import time

    import httpx

    (a_id,) = server.engine.tokenizer.encode("a", add_special_tokens=False)
    runs_of_a = {  # only "a"s: every token extends the run the pattern backtracks over
        "text": "Say a",
        "rid": "runs-of-a",
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 3500,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {str(a_id): 100},
            "stop_regex": [PATHOLOGICAL],
        },
    }
    started, outcome = threading.Event(), {}

    def bad() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            with client.stream("POST", "/generate", json=runs_of_a) as response:
                started.set()
                outcome["bad"] = response.status_code
                events = [line for line in response.iter_lines() if line]
                outcome["last"] = events[-2]  # before [DONE]

    worker = threading.Thread(target=bad, daemon=True)
    worker.start()
    assert started.wait(60)
    # the bad request goes on: 200 "a"s (re would need years for one scan); another request
    # completes meanwhile
    for _ in range(2400):
        if server.engine.stats()["decode_tokens_total"] >= 200:
            break
        time.sleep(0.05)
    assert server.engine.stats()["decode_tokens_total"] >= 200
    with httpx.Client(base_url=server.url, timeout=60) as client:
        small = client.post(
            "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}
        )
    assert small.status_code == 200 and small.json()["meta_info"]["completion_tokens"] == 1
    server.engine.abort("runs-of-a")  # at once: no scan holds the engine's thread
    worker.join(60)
    assert outcome["bad"] == 200, outcome
    assert json.loads(outcome["last"].removeprefix("data: "))["meta_info"]["finish_reason"] == {
        "type": "abort"
    }
