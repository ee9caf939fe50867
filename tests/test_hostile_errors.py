"""How the server says a request failed: one error shape for every status (FastAPI's own 404,
405 and body-parse errors included), stream frames that carry the failure's own status (and
make OpenAI's client raise), and a score that stops when its client leaves."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from conftest import ServerThread

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import GenerateResult
from runtime.server.errors import failure_of, status_of

LONG = {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=2000))
    thread = ServerThread(engine, request_timeout_s=1.0)
    yield thread
    thread.stop()


def assert_error_shape(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and "detail" not in response.json()
    return error["message"]


def test_routing_and_body_parse_errors_have_our_shape(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert_error_shape(client.get("/no/such/route"), 404)
        assert client.delete("/generate").headers["allow"]  # 405 keeps its Allow header
        assert_error_shape(client.delete("/generate"), 405)
        response = client.post(
            "/generate", content=b'{"text": "\xff"}', headers={"content-type": "application/json"}
        )
        assert "utf-8" in assert_error_shape(response, 400)


def test_an_empty_prompt_list_is_a_400_naming_the_field(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response = client.post("/v1/completions", json={"prompt": []})
        assert "`prompt` is an empty list" in assert_error_shape(response, 400)


def sse_frames(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


def test_a_timed_out_sglang_stream_ends_with_a_408_frame(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": LONG, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream("POST", "/generate", json=body) as response:
            frames = sse_frames(response)
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == 408 and "timeout passed" in error["message"]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_failed_openai_stream_ends_in_an_error_the_client_raises(server, api):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        pin = http.post("/v1/flowlang/pin", json={"prefix_ids": list(range(1, 701))}).json()
        try:  # 700 of 2,000 slots pinned: a 1,504-slot request is crowded out (503)
            if api == "completions":
                stream = client.completions.create(
                    model=client.models.list().data[0].id,
                    prompt=list(range(700, 2200)),
                    max_tokens=4,
                    stream=True,
                )
            else:
                stream = client.chat.completions.create(
                    model=client.models.list().data[0].id,
                    messages=[{"role": "user", "content": "hello " * 1500}],
                    max_tokens=4,
                    stream=True,
                )
            finishes = []
            with pytest.raises(openai.APIError) as raised:
                finishes.extend(c.choices[0].finish_reason for c in stream if c.choices)
            assert raised.value.body["code"] == 503 and "retry later" in raised.value.message
            assert "stop" not in finishes
        finally:
            http.delete(f"/v1/flowlang/pin/{pin['pin_id']}")


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"finish_reason": "error", "error": "bad", "error_kind": "invalid"}, 400),
        ({"finish_reason": "error", "error": "full", "error_kind": "busy"}, 503),
        ({"finish_reason": "error", "error": "bug", "error_kind": "internal"}, 500),
        ({"finish_reason": "abort", "error": "timeout passed", "error_kind": "timeout"}, 408),
        ({"finish_reason": "abort", "error": "aborted by its client"}, None),
        ({"finish_reason": "abort"}, None),  # the client's own abort: not a failure
        ({"finish_reason": "stop"}, None),
    ],
)
def test_each_kind_of_failure_has_its_status(fields, status):
    counts = {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 0}
    failure = failure_of(GenerateResult(rid="r", text="", output_ids=[], **counts, **fields))
    assert (failure and status_of(failure)) == status


def test_a_score_whose_client_leaves_is_aborted(server):
    engine = server.engine
    conts = [[100 + i] + [5 + (i * 7 + j) % 400 for j in range(1500)] for i in range(48)]
    before = engine.stats()
    with httpx.Client(base_url=server.url, timeout=1.0) as client:
        with pytest.raises(httpx.TimeoutException):
            client.post("/v1/flowlang/score", json={"prefix": [1, 2, 3], "continuations": conts})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        time.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["requests_aborted_total"] > before["requests_aborted_total"]
    computed = stats["prefill_tokens_total"] - before["prefill_tokens_total"]
    assert computed < 48 * 1500 / 2  # stopped: most continuations were never computed
    engine.check_integrity()


@pytest.mark.parametrize("depth", [65, 2500])
def test_a_schema_nested_too_deeply_is_a_400_on_both_routes(server, depth):
    schema = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
    bodies = {  # built as text: Python's json cannot even write 2,500 levels
        "/generate": '{"text": "hi", "sampling_params": {"json_schema": ' + json.dumps(schema),
        "/v1/flowlang/generate": '{"text": "hi", "constraint": {"json_schema": ' + schema,
    }
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path, body in bodies.items():
            headers = {"content-type": "application/json"}
            response = client.post(path, content=body + "}}", headers=headers)
            message = assert_error_shape(response, 400)
            assert "nests" in message or "recursion depth" in message


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": LONG}),
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True}),
    ],
)
def test_a_request_past_the_servers_timeout_is_a_408(server, path, body):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert "timeout passed" in assert_error_shape(client.post(path, json=body), 408)
