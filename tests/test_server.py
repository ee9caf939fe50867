"""The HTTP server on loopback: the real openai client, SGLang-shaped /generate, bad input,
disconnects, pins with leases, API keys and namespaces, a bounded load test."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import ServerThread
from openai import OpenAI

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import (
    EngineClosedError,
    InvalidRequestError,
    RequestError,
    UnknownRequestError,
)

BOUNDED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"type": "string", "enum": ["a", "b"]},
    },
    "required": ["ok", "n", "tag"],
}


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def stats(served) -> dict:
    return served.engine.stats()


# ---------------------------------------------------------------- OpenAI
def test_openai_client_completions_chat_streaming_schema_usage(served):
    oc = OpenAI(base_url=served.url + "/v1", api_key="unused")
    assert oc.models.list().data[0].id == served.engine.config.model
    done = oc.completions.create(
        model=oc.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        logprobs=2,
    )
    choice = done.choices[0]
    assert done.usage.completion_tokens == 6 and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == 6 and len(choice.logprobs.top_logprobs[0]) == 2
    messages = [{"role": "user", "content": "Say hello to the new customer, please."}]
    first = oc.chat.completions.create(
        model=oc.models.list().data[0].id,
        messages=messages,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        n=2,
    )
    prompt_len = len(
        served.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert first.usage.prompt_tokens == prompt_len  # the prompt counts once, whatever n
    assert (
        len(first.choices) == 2
        and first.choices[0].message.content == first.choices[1].message.content
    )  # greedy twice
    assert len(first.choices[0].logprobs.content[0].top_logprobs) == 3
    again = oc.chat.completions.create(
        model=oc.models.list().data[0].id, messages=messages, max_tokens=8, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    streamed = oc.chat.completions.create(
        model=oc.models.list().data[0].id,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == first.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    structured = oc.chat.completions.create(
        model=oc.models.list().data[0].id,
        messages=[{"role": "user", "content": "Give JSON."}],
        max_tokens=60,
        temperature=0.7,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BOUNDED}},
    )
    value = json.loads(structured.choices[0].message.content)
    assert set(value) == {"ok", "n", "tag"} and 0 <= value["n"] <= 9


# ---------------------------------------------------------------- SGLang native
def test_sglang_generate_single_batch_stream_regex_logprobs(client):
    one = client.post(
        "/generate",
        json={
            "text": "The weather today",
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = one["meta_info"]
    assert meta["completion_tokens"] == 5 and meta["finish_reason"]["type"] == "length"
    assert len(meta["output_token_logprobs"]) == 5
    logprob, token_id, text = meta["output_token_logprobs"][0]
    assert logprob < 0 and isinstance(token_id, int) and isinstance(text, str)
    assert len(meta["output_top_logprobs"][0]) == 2
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] - 1
    batch = client.post(
        "/generate",
        json={
            "text": ["a b", "b c d e"],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "logprob_start_len": 1,
        },
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    for item in batch:  # input logprobs of every prompt, batch or not
        meta_b = item["meta_info"]
        assert len(meta_b["input_token_logprobs"]) == meta_b["prompt_tokens"] - 1
    ids = client.post(
        "/generate",
        json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2}},
    ).json()
    assert [r["meta_info"]["prompt_tokens"] for r in ids] == [3, 2]
    regex = client.post(
        "/generate",
        json={
            "text": "Code:",
            "sampling_params": {"regex": r"[A-Z]{3}-\d{2}", "max_new_tokens": 20},
        },
    ).json()
    assert len(regex["text"]) == 6 and regex["text"][3] == "-"
    schema = client.post(
        "/generate",
        json={
            "text": "JSON:",
            "sampling_params": {"json_schema": json.dumps(BOUNDED), "max_new_tokens": 60},
        },
    ).json()
    assert set(json.loads(schema["text"])) == {"ok", "n", "tag"}
    with client.stream(
        "POST",
        "/generate",
        json={
            "text": "The weather today",
            "stream": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
        },
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2][len("data: ") :])
    assert final["text"] == one["text"] and final["meta_info"]["completion_tokens"] == 5


def test_operations_endpoints(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/get_model_info").json()["is_generation"] is True
    info = client.get("/server_info").json()
    assert info["config"]["page_size"] == 1 and "prefill_tokens_total" in info["stats"]
    metrics = client.get("/metrics").text
    for name in (
        "flowlang_prefill_tokens_total",
        "flowlang_cache_hit_rate",
        "flowlang_num_running",
        "flowlang_kv_slots_used",
        "flowlang_http_pins",
    ):
        assert f"\n{name} " in "\n" + metrics, name
    assert client.post("/flush_cache").json()["flushed_tokens"] >= 0


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 422, "JSON"),
        ({"text": 5}, 422, "text"),
        ({"text": "x", "bogus": 1}, 422, "bogus"),
        ({"text": "x", "input_ids": [1]}, 422, "exactly one of text or input_ids"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 10_000}}, 400, "context"),
        ({"input_ids": [1] * 9000}, 400, "context"),
        ({"input_ids": [99_999_999]}, 400, "outside the vocabulary"),
        ({"text": "x", "sampling_params": {"regex": "(a"}}, 400, "invalid regex"),
        ({"text": "x", "sampling_params": {"json_schema": "{nope"}}, 400, "not valid JSON"),
        ({"text": "x", "sampling_params": {"temperature": -1}}, 422, "temperature"),
        ({"text": "x", "sampling_params": {"frequency_penalty": 5}}, 400, "frequency_penalty"),
        ({"text": "x", "lora_path": "adapter"}, 400, "lora_path: not supported"),
        ({"text": "x", "sampling_params": {"stop_regex": "(a"}}, 400, "invalid stop_regex"),
        ({"text": ["a", "b"], "rid": ["r1"]}, 400, "1 ids for 2 prompts"),
    ],
)
def test_bad_input_is_a_clear_4xx_and_nothing_else_is_disturbed(client, body, status, message):
    kwargs = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    response = client.post("/generate", **kwargs)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    ok = client.post("/generate", json={"text": "fine", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_openai_bad_input(client):
    response = client.post("/v1/chat/completions", json={"messages": []})
    assert response.status_code == 422
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 100_000})
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    response = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
        },
    )
    assert response.status_code == 422 and "schema" in response.json()["error"]["message"]


def test_a_refused_prompt_in_a_batch_aborts_the_ones_already_queued(served, client):
    before = stats(served)["requests_aborted_total"]
    body = {
        "input_ids": [[5, 6, 7], [99_999_999]],
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 400 and "vocabulary" in response.json()["error"]["message"]
    assert wait_for(lambda: stats(served)["requests_aborted_total"] == before + 1)
    assert wait_for(lambda: stats(served)["num_running"] == 0)


@pytest.mark.parametrize(
    "error, status, message",
    [
        (InvalidRequestError("bad prompt"), 400, "bad prompt"),
        (UnknownRequestError("no request 'r9'"), 404, "no request 'r9'"),
        (RequestError("the step failed"), 500, "the step failed"),
        (EngineClosedError("the engine is closed"), 503, "shutting down"),
        (KeyError("slot"), 500, "internal server error"),  # a bug, not a missing resource
        (ValueError("bad shape"), 500, "internal server error"),  # a bug, not bad input
    ],
)
def test_each_error_has_one_status_and_stray_ones_are_500(
    served, client, monkeypatch, error, status, message
):
    def fail():
        raise error

    monkeypatch.setattr(served.engine, "flush_cache", fail)
    response = client.post("/flush_cache")
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


def test_unknown_pin_id_is_404(client):
    for response in (
        client.post("/v1/flowlang/pin/pin-nope/renew"),
        client.delete("/v1/flowlang/pin/pin-nope"),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "no pin 'pin-nope' held by this client"


def test_a_declared_return_time_travels_over_http_and_a_negative_one_is_refused(client):
    body = {"input_ids": list(range(20, 60)), "sampling": {"max_new_tokens": 2}}
    told = {"continuation": True, "next_turn_after_s": 12.5}
    done = client.post("/v1/flowlang/generate", json={**body, "hints": told})
    assert done.status_code == 200, done.text
    bad = client.post("/v1/flowlang/generate", json={**body, "hints": {"next_turn_after_s": -1}})
    assert bad.status_code in (400, 422), bad.text
    assert "next_turn_after_s" in bad.text


def test_request_size_limit(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, max_body_bytes=1000)
    try:
        response = httpx.post(thread.url + "/generate", json={"text": "x" * 5000})
        assert response.status_code == 413 and "exceeds the limit" in response.text
    finally:
        thread.stop()


# ---------------------------------------------------------------- lifecycle
def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_mid_stream_aborts_and_frees(served, client):
    before = stats(served)["requests_aborted_total"]
    with client.stream(
        "POST",
        "/generate",
        json={
            "text": "Tell a long story",
            "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
        },
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then hang up
    assert wait_for(lambda: stats(served)["requests_aborted_total"] == before + 1)
    assert wait_for(lambda: stats(served)["num_running"] == 0)
    served.engine.flush_cache()
    assert stats(served)["kv_slots_used"] == 0
    served.engine.check_integrity()


def test_pins_over_http_with_leases(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, pin_lease_seconds=1.0)
    try:
        with httpx.Client(base_url=thread.url) as c:
            pin = c.post("/v1/flowlang/pin", json={"prefix_ids": list(range(50, 90))}).json()
            assert engine.stats()["num_pins"] == 1
            kept = c.post(
                "/v1/flowlang/pin", json={"prefix_ids": list(range(100, 140)), "lease_seconds": 60}
            ).json()
            assert c.delete(f"/v1/flowlang/pin/{kept['pin_id']}").json()["released"]
            # the first client "vanishes": no renewals, its lease runs out
            assert wait_for(lambda: engine.stats()["num_pins"] == 0, timeout=10)
            assert c.post(f"/v1/flowlang/pin/{pin['pin_id']}/renew").status_code == 404
            assert "flowlang_http_pins_expired_total 1" in c.get("/metrics").text
    finally:
        thread.stop()
    assert engine._closed, "shutting the server down closes the engine"


def test_api_keys_and_per_key_namespaces(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, api_keys=("alpha", "beta"))
    body = {"input_ids": list(range(200, 260)), "sampling_params": {"max_new_tokens": 1}}
    try:
        assert httpx.post(thread.url + "/generate", json=body).status_code == 401
        assert httpx.get(thread.url + "/health").status_code == 200

        def call(key):
            return httpx.post(
                thread.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}
            ).json()

        assert call("alpha")["meta_info"]["cached_tokens"] == 0
        assert call("alpha")["meta_info"]["cached_tokens"] > 0
        assert call("beta")["meta_info"]["cached_tokens"] == 0, "tenants never share the cache"
    finally:
        thread.stop()


def test_bounded_load_test_64_clients(served):
    """64 concurrent clients for a bounded time on loopback: no errors, no leaks."""
    errors: list[str] = []
    done = []
    deadline = time.monotonic() + 12

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=served.url, timeout=120) as c:
            while time.monotonic() < deadline:
                body = {
                    "text": f"Customer {i % 8} asks about order {i}",
                    "sampling_params": {"max_new_tokens": 4 + i % 5, "temperature": 0.5},
                }
                response = c.post("/generate", json=body)
                if response.status_code != 200:
                    errors.append(response.text)
                    return
                done.append(1)

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(done) >= 64
    assert wait_for(lambda: stats(served)["num_running"] == 0 and stats(served)["num_waiting"] == 0)
    served.engine.check_integrity()
    served.engine.flush_cache()
    assert stats(served)["kv_slots_used"] == 0
