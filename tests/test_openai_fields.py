"""Every request field of the OpenAI routes is honoured or refused by name: the upstream request
schemas (the `openai` package's TypedDicts) and vLLM's extensions are walked field by field, and
each declared field set to a non-default value changes what the engine is asked to do (or what
is answered), is logged as having no effect, or is a 400 that names it. Then the fields whose
behaviour is easy to get subtly wrong: usage with n, logit_bias (greedy, sampled, constrained,
speculative), vLLM's guided_* and structured_outputs, logprobs in streams (OpenAI's chunks and
SGLang's meta_info deltas), echo, max_tokens' defaults, the model name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import recording_server
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import OpenAI
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import TypeAdapter, ValidationError

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.generation import GenerationState
from runtime.model.sampler import sample
from runtime.protocol import Constraint, GenerateRequest, SamplingParams
from runtime.server.schemas import ChatBody, CompletionBody, StreamOptions, StructuredOutputs

POOL_TOKENS = 4096
CHAT = {"messages": [{"role": "user", "content": "Say hi to the new customer."}]}
COMPLETION = {"prompt": "Once upon a time"}
BASE = {"max_tokens": 4, "temperature": 0}
ROUTES = {"/v1/chat/completions": (ChatBody, CHAT), "/v1/completions": (CompletionBody, COMPLETION)}

# vLLM's extensions of the two request bodies (its ChatCompletionRequest and CompletionRequest)
VLLM_COMMON = [
    "guided_choice", "guided_regex", "guided_json", "guided_grammar", "structured_outputs",
    "guided_decoding_backend", "guided_whitespace_pattern", "top_k", "min_p",
    "repetition_penalty", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "spaces_between_special_tokens", "priority", "request_id",
    "logits_processors", "bad_words", "truncate_prompt_tokens", "prompt_logprobs",
    "allowed_token_ids", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
    "kv_transfer_params", "vllm_xargs", "use_beam_search", "length_penalty",
]  # fmt: skip
VLLM_EXTRAS = {
    "/v1/chat/completions": [
        *VLLM_COMMON, "echo", "add_generation_prompt", "continue_final_message",
        "chat_template", "chat_template_kwargs", "add_special_tokens", "documents",
        "mm_processor_kwargs", "include_reasoning",
    ],
    "/v1/completions": [*VLLM_COMMON, "echo", "add_special_tokens", "response_format"],
}  # fmt: skip


def kind_of(model: type, name: str) -> str:
    extra = model.model_fields[name].json_schema_extra or {}
    return extra.get("kind", "honoured")


def declared(model: type) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def non_default(model: type, name: str) -> Any:
    """A value of the field's type other than its default (what a client that sets it sends)."""
    info = model.model_fields[name]
    adapter = TypeAdapter(info.annotation)
    for candidate in (True, False, 1, "x", ["x"], [1], {"k": "v"}, {"x": 1}):
        try:
            value = adapter.validate_python(candidate, strict=True)
        except ValidationError:
            continue
        if value != info.default:
            return candidate
    raise AssertionError(f"no non-default value for {name}")


# ---------------------------------------------------------------- the schemas, walked
@pytest.mark.parametrize(
    "params, body",
    [
        (chat_create_params.CompletionCreateParamsBase, ChatBody),
        (completion_create_params.CompletionCreateParamsBase, CompletionBody),
    ],
)
def test_every_openai_field_is_declared(params, body):
    upstream = params.__required_keys__ | params.__optional_keys__
    missing = sorted(upstream - declared(body))
    assert not missing, f"OpenAI fields {body.__name__} does not declare: {missing}"
    options = ChatCompletionStreamOptionsParam.__required_keys__
    options |= ChatCompletionStreamOptionsParam.__optional_keys__
    assert not sorted(options - declared(StreamOptions))


# ---------------------------------------------------------------- one server, its requests
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A tiny-model server that records the engine requests each call submits."""
    thread = recording_server(
        Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=POOL_TOKENS))
    )
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(server, http, route: str, extra: dict, base: dict = BASE) -> tuple[httpx.Response, list]:
    """POST `route` with its sample body, BASE and `extra`; the answer and the requests run."""
    server.submitted.clear()
    response = http.post(route, json={**ROUTES[route][1], **base, **extra})
    requests = server.submitted[0] if server.submitted else []
    return response, [r.model_dump(exclude={"rid"}) for r in requests]


def sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    frames = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(f) for f in frames[:-1]]


def test_vllm_extensions_are_declared_or_refused_by_name(server, http):
    for route, names in VLLM_EXTRAS.items():
        body = ROUTES[route][0]
        for name in names:
            if name in declared(body):
                continue
            response, _ = post(server, http, route, {name: 1})
            assert response.status_code in (400, 422), (route, name, response.text)
            assert name in response.json()["error"]["message"], (route, name)


REQUEST = "request"  # the engine is asked something else than for the plain body
# honoured on reasoning models only (this tiny one has no reasoning format): tested there
ELSEWHERE = "tests/test_openai_tools.py::test_reasoning_content_split_and_streamed"
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


def answer_differs(key: str) -> Any:
    return lambda response, plain: response.json()[key] != plain.json()[key]


def streamed(response, plain) -> bool:
    return response.headers["content-type"].startswith("text/event-stream") and sse(response)


def with_usage_chunk(response, plain) -> bool:
    return "usage" in sse(response)[-1]


def refused(name: str) -> tuple[int, str]:
    return (400, name)


COMMON_PROBES: dict[str, tuple[dict, Any]] = {
    "model": ({"model": "no-such-model"}, (404, "no-such-model")),
    "max_tokens": ({"max_tokens": 2}, REQUEST),
    "temperature": ({"temperature": 0.7}, REQUEST),
    "top_p": ({"top_p": 0.5}, REQUEST),
    "n": ({"n": 2}, REQUEST),
    "stop": ({"stop": ["x"]}, REQUEST),
    "seed": ({"seed": 3}, REQUEST),
    "frequency_penalty": ({"frequency_penalty": 0.5}, REQUEST),
    "presence_penalty": ({"presence_penalty": 0.5}, REQUEST),
    "logit_bias": ({"logit_bias": {"5": 3}}, REQUEST),
    "stream": ({"stream": True}, streamed),
    "stream_options": (
        {"stream": True, "stream_options": {"include_usage": True}},
        with_usage_chunk,
    ),
    "top_k": ({"top_k": 5}, REQUEST),
    "min_p": ({"min_p": 0.1}, REQUEST),
    "repetition_penalty": ({"repetition_penalty": 1.2}, REQUEST),
    "stop_token_ids": ({"stop_token_ids": [5]}, REQUEST),
    "skip_special_tokens": ({"skip_special_tokens": False}, REQUEST),
    "ignore_eos": ({"ignore_eos": True}, REQUEST),
    "min_tokens": ({"min_tokens": 2}, REQUEST),
    "include_stop_str_in_output": ({"include_stop_str_in_output": True}, REQUEST),
    "regex": ({"regex": "[ab]+"}, REQUEST),
    "ebnf": ({"ebnf": 'root ::= "a"'}, REQUEST),
    "guided_regex": ({"guided_regex": "[ab]+"}, REQUEST),
    "guided_choice": ({"guided_choice": ["yes", "no"]}, REQUEST),
    "guided_json": ({"guided_json": {"type": "object"}}, REQUEST),
    "guided_grammar": ({"guided_grammar": 'root ::= "a"'}, REQUEST),
    "structured_outputs": ({"structured_outputs": {"choice": ["yes", "no"]}}, REQUEST),
    "priority": ({"priority": 3}, REQUEST),
    # agent hints (the mapping is tests/test_agent_hints.py's)
    "session_id": ({"session_id": "run-1"}, REQUEST),
    "nvext": ({"nvext": {"agent_hints": {"osl": 8}}}, REQUEST),
    "hints": ({"hints": {"continuation": True}}, REQUEST),
    "namespace": ({"namespace": "team-a"}, REQUEST),
    "cache_salt": ({"cache_salt": "team-a"}, REQUEST),
}
PROBES = {
    "/v1/chat/completions": {
        **COMMON_PROBES,
        "messages": ({"messages": [{"role": "user", "content": "Bye."}]}, REQUEST),
        "max_completion_tokens": ({"max_completion_tokens": 2}, REQUEST),
        "logprobs": ({"logprobs": True}, REQUEST),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 2}, REQUEST),
        "response_format": ({"response_format": {"type": "json_object"}}, REQUEST),
        "tools": ({"tools": [TOOL]}, REQUEST),
        "tool_choice": ({"tools": [TOOL], "tool_choice": "required"}, REQUEST),
        "parallel_tool_calls": ({"tools": [TOOL], "parallel_tool_calls": False}, REQUEST),
        "modalities": ({"modalities": ["audio"]}, (422, "modalities")),  # text is all there is
        "chat_template_kwargs": ({}, ELSEWHERE),
        "separate_reasoning": ({}, ELSEWHERE),
        "max_reasoning_tokens": ({"max_reasoning_tokens": 4}, refused("max_reasoning_tokens")),
        "add_generation_prompt": ({"add_generation_prompt": False}, REQUEST),
        "continue_final_message": (
            {
                "messages": [*CHAT["messages"], {"role": "assistant", "content": "Hello"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            REQUEST,
        ),
    },
    "/v1/completions": {
        **COMMON_PROBES,
        "prompt": ({"prompt": [5, 6, 7]}, REQUEST),
        "logprobs": ({"logprobs": 2}, REQUEST),
        "echo": ({"echo": True}, answer_differs("choices")),
        "best_of": ({"best_of": 2}, refused("best_of")),
        "add_special_tokens": ({"add_special_tokens": False}, REQUEST),
    },
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_declared_field_is_honoured_logged_or_refused(server, http, route, caplog):
    body = ROUTES[route][0]
    plain, plain_requests = post(server, http, route, {})
    assert plain.status_code == 200, plain.text
    probes = PROBES[route]
    honoured = {n for n in body.model_fields if kind_of(body, n) == "honoured"}
    names = {body.model_fields[n].alias or n for n in honoured}
    assert names == set(probes), f"probe each honoured field: {sorted(names ^ set(probes))}"
    for name, (extra, expect) in probes.items():
        response, requests = post(server, http, route, extra)
        if expect == ELSEWHERE:
            source = (Path(__file__).parent / "test_openai_tools.py").read_text()
            assert f"def {expect.split('::')[1]}(" in source and name in source
        elif expect == REQUEST:
            assert response.status_code == 200, (name, response.text)
            assert requests != plain_requests, f"{route} {name} changed nothing"
        elif isinstance(expect, tuple):
            status, named = expect
            assert response.status_code == status, (name, response.text)
            assert named in response.json()["error"]["message"], (name, response.text)
        else:
            assert response.status_code == 200, (name, response.text)
            assert expect(response, plain), f"{route} {name} changed nothing"
    for name in body.model_fields:
        kind = kind_of(body, name)
        if kind == "honoured":
            continue
        wire = body.model_fields[name].alias or name
        caplog.clear()
        with caplog.at_level("WARNING", logger="flowlang.server"):
            response, _ = post(server, http, route, {wire: non_default(body, name)})
        if kind == "ignored":
            assert response.status_code == 200, (name, response.text)
            assert wire in caplog.text, f"{route} {name} is ignored without a word"
        else:
            assert response.status_code == 400, (name, response.text)
            assert name in response.json()["error"]["message"]


@pytest.mark.parametrize("nested, field", [(StreamOptions, "stream_options"),
                                           (StructuredOutputs, "structured_outputs")])  # fmt: skip
def test_nested_fields_are_logged_or_refused(server, http, nested, field, caplog):
    base = {"stream": True} if field == "stream_options" else {"structured_outputs": {}}
    for name in nested.model_fields:
        kind = kind_of(nested, name)
        if kind == "honoured":
            continue
        value = {name: non_default(nested, name)}
        caplog.clear()
        with caplog.at_level("WARNING", logger="flowlang.server"):
            response, _ = post(server, http, "/v1/chat/completions", {**base, field: value})
        if kind == "ignored":
            assert response.status_code == 200 and f"{field}.{name}" in caplog.text
        else:
            assert response.status_code == 400, response.text
            assert f"{field}.{name}" in response.json()["error"]["message"]


def test_user_is_accepted_and_logged(server, http, caplog):
    for route in ROUTES:
        with caplog.at_level("WARNING", logger="flowlang.server"):
            response, requests = post(server, http, route, {"user": "u-42"})
        assert response.status_code == 200 and "user" in caplog.text


# ---------------------------------------------------------------- usage, n, streams
def test_usage_counts_each_prompt_once_whatever_n(server, http):
    one, _ = post(server, http, "/v1/chat/completions", {"n": 1})
    three, _ = post(server, http, "/v1/chat/completions", {"n": 3})
    assert three.json()["usage"]["prompt_tokens"] == one.json()["usage"]["prompt_tokens"]
    assert three.json()["usage"]["completion_tokens"] == 3 * 4
    prompts = ["Once upon a time", "The weather today is"]
    lengths = []
    for p in prompts:
        single, _ = post(server, http, "/v1/completions", {"prompt": p, "n": 1})
        lengths.append(single.json()["usage"]["prompt_tokens"])
    both, _ = post(server, http, "/v1/completions", {"prompt": prompts, "n": 3})
    usage = both.json()["usage"]
    assert usage["prompt_tokens"] == sum(lengths)
    assert usage["completion_tokens"] == 2 * 3 * 4 and len(both.json()["choices"]) == 6


def test_n_streams_every_choice_with_usage(server, http):
    for route in ROUTES:
        extra = {"n": 3, "stream": True, "stream_options": {"include_usage": True}}
        response, _ = post(server, http, route, extra, base={"max_tokens": 4, "temperature": 1})
        chunks = sse(response)
        finished = {
            c["choices"][0]["index"] for c in chunks[:-1] if c["choices"][0]["finish_reason"]
        }
        assert finished == {0, 1, 2}, route
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
        whole, _ = post(server, http, route, {"n": 3}, base={"max_tokens": 4, "temperature": 1})
        assert chunks[-1]["usage"]["prompt_tokens"] == whole.json()["usage"]["prompt_tokens"]


def stream_logprobs(route: str, chunks: list[dict]) -> tuple[list[float], list[str]]:
    """Every streamed chunk's logprobs and texts, in order."""
    values, texts = [], []
    for chunk in chunks:
        for choice in chunk["choices"]:
            lps = choice["logprobs"]
            if route == "/v1/completions":
                texts.append(choice["text"])
                values += lps["token_logprobs"] if lps else []
                if choice["text"] and not choice["finish_reason"]:
                    assert lps and "".join(lps["tokens"]), chunk  # text comes with its tokens
            else:
                texts.append(choice["delta"].get("content") or "")
                values += [c["logprob"] for c in lps["content"]] if lps else []
                if choice["delta"].get("content") and len(chunks) > 2:
                    assert lps and lps["content"], chunk
    return values, texts


def test_logprobs_stream_with_the_text_they_belong_to(server, http):
    extras = {"/v1/chat/completions": {"logprobs": True, "top_logprobs": 2},
              "/v1/completions": {"logprobs": 2}}  # fmt: skip
    base = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    for route, extra in extras.items():
        whole, _ = post(server, http, route, extra, base=base)
        choice = whole.json()["choices"][0]
        if route == "/v1/completions":
            expected, text = choice["logprobs"]["token_logprobs"], choice["text"]
        else:
            expected = [c["logprob"] for c in choice["logprobs"]["content"]]
            text = choice["message"]["content"]
        response, _ = post(server, http, route, {**extra, "stream": True}, base=base)
        values, texts = stream_logprobs(route, sse(response))
        assert values == pytest.approx(expected, abs=1e-4) and len(values) == 12, route
        assert "".join(texts) == text


def test_sglang_stream_sends_the_new_logprobs_in_each_chunk(server, http):
    body = {
        "text": "The weather today",
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": True,
    }
    chunks = sse(http.post("/generate", json=body))
    assert len(chunks) > 2
    seen = 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - seen
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        seen = meta["completion_tokens"]
    assert seen == 10
    whole = http.post("/generate", json={**body, "stream": False}).json()["meta_info"]
    streamed = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in streamed] == [e[1] for e in whole["output_token_logprobs"]]


def test_completions_stream_usage_and_echo_of_token_prompts(server, http):
    response, _ = post(
        server, http, "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": True}},
    )  # fmt: skip
    chunks = sse(response)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["usage"]["prompt_tokens"]
    assert all("usage" not in c for c in chunks[:-1])
    engine = server.engine
    ids = engine.tokenizer.encode("Once upon a time")
    echoed, _ = post(server, http, "/v1/completions", {"prompt": ids, "echo": True})
    plain, _ = post(server, http, "/v1/completions", {"prompt": ids})
    text = engine.tokenizer.decode(ids)
    assert echoed.json()["choices"][0]["text"] == text + plain.json()["choices"][0]["text"]


# ---------------------------------------------------------------- refusals, defaults, model
@pytest.mark.parametrize(
    "route, extra, named",
    [
        ("/v1/completions", {"best_of": 3, "n": 2}, "best_of"),
        ("/v1/completions", {"suffix": "The end."}, "suffix"),
        ("/v1/completions", {"logit_bias": {"10000000": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"-3": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"regex": "a+", "structured_outputs": {"json": {}}},
         "structured_outputs.json"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                                  "guided_json": {"type": "object"}}, "response_format"),
        ("/v1/chat/completions", {"structured_outputs": {"choice": ["a"], "regex": "b"}},
         "structured_outputs.choice"),
        ("/v1/chat/completions", {"guided_json": "{not json"}, "guided_json"),
    ],
)  # fmt: skip
def test_refused_by_name(server, http, route, extra, named):
    response, _ = post(server, http, route, extra)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_best_of_equal_to_n_is_honoured(server, http):
    response, requests = post(server, http, "/v1/completions", {"best_of": 2, "n": 2})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(server, http):
    engine = server.engine
    room = min(engine.arch.max_context_len, engine.intake.num_slots)
    long = " ".join(["word"] * (room - 200))
    base = {"temperature": 0, "ignore_eos": True}
    response, requests = post(
        server, http, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]},
        base=base,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 256 and usage["completion_tokens"] > 16
    assert usage["prompt_tokens"] + usage["completion_tokens"] == room
    assert requests[0]["sampling"]["max_new_tokens"] == room - usage["prompt_tokens"]
    too_long = " ".join(["word"] * (room + 10))
    response, _ = post(
        server, http, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": too_long}]}, base=base,
    )  # fmt: skip
    assert response.status_code == 400
    _, requests = post(server, http, "/v1/completions", {}, base={"temperature": 0})
    assert requests[0]["sampling"]["max_new_tokens"] == 16  # OpenAI's default for completions


def test_an_unknown_model_is_a_404_in_openais_shape(server, http):
    for route in ROUTES:
        response, requests = post(server, http, route, {"model": "no-such-model"})
        assert response.status_code == 404 and not requests
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
        assert error["type"] == "invalid_request_error"
    oc = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    served = oc.models.list().data[0].id
    done = oc.completions.create(model=served, prompt="Hi", max_tokens=2)
    assert done.model == served and done.usage.completion_tokens == 2


# ---------------------------------------------------------------- constraints, vLLM's names
def test_vllm_guided_fields_constrain_the_output(server, http):
    base = {"max_tokens": 24, "temperature": 1.0, "seed": 1}
    cases = [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ({"structured_outputs": {"regex": "x[ab]{2}"}}, lambda t: re.fullmatch("x[ab]{2}", t)),
        ({"guided_grammar": 'root ::= "ok" | "fine"'}, lambda t: t in ("ok", "fine")),
        ({"structured_outputs": {"grammar": 'root ::= "go"'}}, lambda t: t == "go"),
        ({"guided_json": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"]}), "max_tokens": 60},
         lambda t: isinstance(json.loads(t)["a"], int)),
        ({"structured_outputs": {"json_object": True}, "max_tokens": 60},
         lambda t: isinstance(json.loads(t), dict)),
    ]  # fmt: skip
    for route in ROUTES:
        finished = 0
        for extra, ok in cases:
            response, _ = post(server, http, route, {**extra}, base={**base, **extra})
            assert response.status_code == 200, (route, extra, response.text)
            choice = response.json()["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if choice["finish_reason"] == "stop":  # a JSON text may run out of tokens
                assert ok(text), (route, extra, text)
                finished += 1
        assert finished >= 6, route  # the bounded ones always end where the grammar does


# ---------------------------------------------------------------- logit_bias
def test_logit_bias_over_http_greedy_sampled_and_constrained(server, http):
    token = server.engine.tokenizer.encode(" banana")[0]
    text = server.engine.tokenizer.decode([token])
    bias = {"logit_bias": {str(token): 100}, "ignore_eos": True}
    for route in ROUTES:
        for base in ({"max_tokens": 4, "temperature": 0}, {"max_tokens": 4, "temperature": 1}):
            response, _ = post(server, http, route, bias, base=base)
            choice = response.json()["choices"][0]
            out = choice["text"] if "text" in choice else choice["message"]["content"]
            assert out == text * 4, (route, base, out)
    # under a constraint the bias moves the choice among what the grammar allows
    for pick in ("yes", "no"):
        first = server.engine.tokenizer.encode(pick)[0]
        response, _ = post(
            server, http, "/v1/completions",
            {"guided_choice": ["yes", "no"], "logit_bias": {str(first): 100}},
        )  # fmt: skip
        assert response.json()["choices"][0]["text"] == pick
    # and the SGLang route honours it too
    out = http.post(
        "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True,
                                "logit_bias": {str(token): 100}},
        },
    ).json()  # fmt: skip
    assert out["output_ids"] == [token] * 3


VOCAB = 16


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20), min_size=VOCAB, max_size=VOCAB),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    greedy=st.booleans(),
)
def test_sampler_adds_the_bias_before_choosing(logits, bias, greedy):
    params = SamplingParams(logit_bias=bias, temperature=0 if greedy else 1, seed=0)
    row = GenerationState(params, [1], None, (), VOCAB).sampler
    raw = torch.tensor([logits])
    biased = raw.clone()
    for t, b in bias.items():
        biased[0, t] += b
    out = sample(raw, [row])
    if greedy:
        assert out.token_ids[0] == int(biased.argmax())
    else:
        assert biased[0, out.token_ids[0]] > -50 or all(b <= -50 for b in biased[0].tolist())


def test_sampler_bias_never_draws_a_token_pushed_to_minus_100():
    raw = torch.zeros(1, VOCAB).expand(400, VOCAB)
    params = SamplingParams(logit_bias={3: -100, 7: -100}, temperature=1.0, seed=1)
    rows = [GenerationState(params, [1], None, (), VOCAB).sampler] * 400
    drawn = set(sample(raw, rows).token_ids)
    assert 3 not in drawn and 7 not in drawn and len(drawn) == VOCAB - 2


def test_logit_bias_in_speculative_verification_matches_plain_decoding(tiny_model_dir):
    prompt = "Copy: the cat sat on the mat. the cat sat on the mat. the cat sat on"
    outputs = {}
    for mode in ("off", "tree"):
        config = EngineConfig(
            model=str(tiny_model_dir), max_kv_tokens=POOL_TOKENS, speculative=mode
        )
        with Engine(config) as engine:
            token = engine.tokenizer.encode(" cat")[0]
            greedy = engine.generate(
                [GenerateRequest(text=prompt, sampling=SamplingParams(max_new_tokens=24,
                                 temperature=0, ignore_eos=True))]
            )[0]  # fmt: skip
            avoid = greedy.output_ids[0]
            variants = [
                SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                               logit_bias={token: 100}),
                SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True,
                               logit_bias={avoid: -100}),
                SamplingParams(max_new_tokens=24, temperature=0.8, seed=4, ignore_eos=True,
                               logit_bias={token: 8.0}),
            ]  # fmt: skip
            requests = [GenerateRequest(text=prompt, sampling=v) for v in variants]
            requests.append(
                GenerateRequest(text=prompt, sampling=variants[0],
                                constraint=Constraint(regex="( cat| dog)+"))
            )  # fmt: skip
            results = engine.generate(requests)
            outputs[mode] = [r.output_ids for r in results]
            stats = engine.stats()
            assert results[0].output_ids == [token] * 24
            assert avoid not in results[1].output_ids
            assert results[3].output_ids == [token] * 24
    assert outputs["tree"] == outputs["off"]
    assert stats["spec_accepted_tokens_total"] > 0  # the biased rows were verified in drafts
