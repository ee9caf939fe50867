"""The server under hostile clients: what they send never reaches /metrics as a label, bodies
are bounded however they arrive, admin routes need an admin key, a client that gives up
aborts its work, and /health tells the truth about the engine."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from conftest import ServerThread

from flowlang.cli import read_keys
from runtime.config import EngineConfig
from runtime.engine import Engine

LONG = {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=6000))
    server = ServerThread(
        engine, api_keys=("user-key",), admin_keys=("admin-key",), max_body_bytes=4000
    )
    yield server
    server.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_metrics_count_route_templates_after_auth(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        for i in range(20):
            client.get(f'/junk{i}"}} fake_series 1 #', headers=auth("wrong"))
        client.get("/no/such/route", headers=auth("user-key"))
        client.get("/v1/models", headers=auth("user-key"))
        text = client.get("/metrics", headers=auth("user-key")).text
    assert "junk" not in text and "fake_series" not in text
    assert 'path="unmatched"' in text and 'path="/v1/models"' in text


def test_a_chunked_body_past_the_limit_is_413(guarded):
    def chunks():
        for _ in range(10):
            yield b" " * 1000  # no Content-Length: 10 kB against a 4 kB limit

    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        response = client.post(
            "/generate", content=chunks(), headers={**auth("user-key"), "content-type": "json"}
        )
        assert response.status_code == 413, response.text
        assert "exceeds the limit of 4000 bytes" in response.json()["error"]["message"]
        ok = client.post(
            "/generate",
            json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
            headers=auth("user-key"),
        )
        assert ok.status_code == 200


def test_admin_routes_need_an_admin_key(guarded):
    with httpx.Client(base_url=guarded.url, timeout=30) as client:
        assert client.post("/flush_cache", headers=auth("user-key")).status_code == 403
        assert client.post("/flush_cache", headers=auth("admin-key")).status_code == 200
        assert client.get("/v1/models", headers=auth("admin-key")).status_code == 200


def test_a_non_streaming_client_that_gives_up_aborts_its_request(guarded):
    before = guarded.engine.stats()["requests_aborted_total"]
    with httpx.Client(base_url=guarded.url, timeout=1.5) as client:
        with pytest.raises(httpx.TimeoutException):
            client.post(
                "/generate",
                json={"input_ids": [1, 2, 3], "sampling_params": LONG},
                headers=auth("user-key"),
            )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = guarded.engine.stats()
        if stats["requests_aborted_total"] > before and stats["num_running"] == 0:
            break
        time.sleep(0.1)
    assert stats["requests_aborted_total"] == before + 1 and stats["num_running"] == 0
    guarded.engine.check_integrity()


def test_health_says_503_once_the_engine_is_gone(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=2000))
    server = ServerThread(engine)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get("/health").json() == {"status": "ok"}
            engine.close()
            response = client.get("/health")
            assert response.status_code == 503 and response.json()["status"] == "dead"
    finally:
        server.stop()


def test_keys_come_from_a_file_and_the_environment(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("alpha\n\n beta \n")
    monkeypatch.setenv("FLOWLANG_API_KEYS", "gamma, delta")
    assert read_keys(str(path), "FLOWLANG_API_KEYS") == ("gamma", "delta", "alpha", "beta")
    monkeypatch.delenv("FLOWLANG_API_KEYS")
    assert read_keys(None, "FLOWLANG_API_KEYS") == ()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "a\ud800b", "sampling_params": {"max_new_tokens": 2}}),
        ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a\ud800b"}]},
        ),
        ("/v1/flowlang/tokenize", {"text": "a\ud800b"}),
        ("/v1/flowlang/score", {"prefix": "a\ud800b", "continuations": ["x"]}),
        ("/v1/flowlang/score", {"prefix": [1, 2], "continuations": [[-1]]}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"text": 7}]}]},
        ),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": "Infinity"}}),
    ],
)
def test_client_mistakes_are_4xx_never_500(guarded, path, body):
    with httpx.Client(base_url=guarded.url, timeout=60) as client:
        content = json.dumps(body)  # ASCII escapes: how a lone surrogate travels in JSON
        headers = {**auth("user-key"), "content-type": "application/json"}
        response = client.post(path, content=content, headers=headers)
        assert 400 <= response.status_code < 500, response.text
        control = client.post(
            "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
            headers=auth("user-key"),
        )
        assert control.status_code == 200


@pytest.fixture(scope="module")
def limited(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=2000))
    server = ServerThread(
        engine,
        api_keys=("a-key", "b-key"),
        max_requests_per_key=2,
        max_pinned_tokens_per_key=300,
        body_read_timeout_s=1.0,
        head_timeout_s=1.0,
    )
    yield server
    server.stop()


def test_a_key_over_its_requests_in_flight_gets_429_and_others_do_not(limited):
    endless = {**LONG, "max_new_tokens": 1500}  # fits the 2,000-slot pool, runs for long
    long_body = {"input_ids": [1, 2, 3], "sampling_params": endless}

    def hold(client):  # keeps one of the key's two slots while its long generation runs
        with contextlib.suppress(httpx.TimeoutException):  # the client may give up first
            client.post("/generate", json=long_body, headers=auth("a-key"))

    with httpx.Client(base_url=limited.url, timeout=4) as slow:
        holders = [threading.Thread(target=hold, args=(slow,)) for _ in range(2)]
        for thread in holders:
            thread.start()
        deadline = time.monotonic() + 3
        while limited.engine.stats()["num_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with httpx.Client(base_url=limited.url, timeout=30) as client:
            third = client.post("/generate", json=long_body, headers=auth("a-key"))
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert "2 requests in flight (limit 2)" in third.json()["error"]["message"]
            other = client.post(
                "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                headers=auth("b-key"),
            )
            assert other.status_code == 200
        for thread in holders:
            thread.join()


def test_pins_past_a_keys_quota_get_429(limited):
    with httpx.Client(base_url=limited.url, timeout=30) as client:
        first = client.post(
            "/v1/flowlang/pin", json={"prefix_ids": list(range(1, 201))}, headers=auth("b-key")
        )
        assert first.status_code == 200
        second = client.post(
            "/v1/flowlang/pin", json={"prefix_ids": list(range(1, 151))}, headers=auth("b-key")
        )
        assert second.status_code == 429 and "quota of 300 pinned tokens" in second.text
        pin_id = first.json()["pin_id"]
        assert client.delete(f"/v1/flowlang/pin/{pin_id}", headers=auth("b-key")).status_code < 300


def test_a_request_the_pins_crowd_out_gets_503_with_a_retry_hint(limited):
    with httpx.Client(base_url=limited.url, timeout=30) as client:
        pins = [
            client.post(
                "/v1/flowlang/pin",
                json={"prefix_ids": list(range(k * 300 + 1, k * 300 + 301))},
                headers=auth(key),
            ).json()["pin_id"]
            for k, key in enumerate(("a-key", "b-key"))
        ]
        big = {"input_ids": list(range(700, 2200)), "sampling_params": {"max_new_tokens": 4}}
        response = client.post("/generate", json=big, headers=auth("a-key"))
        assert response.status_code == 503 and response.headers["retry-after"] == "5"
        assert "retry later" in response.json()["error"]["message"]
        for pin_id, key in zip(pins, ("a-key", "b-key"), strict=True):
            client.delete(f"/v1/flowlang/pin/{pin_id}", headers=auth(key))
        assert client.post("/generate", json=big, headers=auth("a-key")).status_code == 200


def test_a_body_that_trickles_in_gets_408(limited):
    def trickle():
        yield b'{"input_ids": [1, 2],'
        time.sleep(2.5)  # past the 1 s read timeout
        yield b' "sampling_params": {"max_new_tokens": 2}}'

    with httpx.Client(base_url=limited.url, timeout=30) as client:
        headers = {**auth("a-key"), "content-type": "application/json"}
        response = client.post("/generate", content=trickle(), headers=headers)
        assert response.status_code == 408, response.text


def test_a_body_that_dribbles_in_gets_408_at_its_deadline(limited):
    def dribble():
        yield b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}'
        for _ in range(30):  # a byte every 0.2 s: each part in time, the whole body not
            time.sleep(0.2)
            yield b" "
        yield b"}"

    with httpx.Client(base_url=limited.url, timeout=30) as client:
        headers = {**auth("a-key"), "content-type": "application/json"}
        started = time.monotonic()
        response = client.post("/generate", content=dribble(), headers=headers)
        assert response.status_code == 408, response.text
        assert "did not arrive within 1 s" in response.text
        assert time.monotonic() - started < 4


def test_an_oversized_constraint_is_refused_at_once(limited):
    regex = "(" + "|".join(f"w{i:06d}" for i in range(20_000)) + ")"  # ~160 kB
    with httpx.Client(base_url=limited.url, timeout=30) as client:
        started = time.monotonic()
        response = client.post(
            "/generate",
            json={"text": "Pick:", "sampling_params": {"max_new_tokens": 2, "regex": regex}},
            headers=auth("a-key"),
        )
        assert response.status_code == 400 and "the limit is 65,536" in response.text
        assert time.monotonic() - started < 10


def dribble_headers(url: str, stop: threading.Event) -> tuple[bytes, float]:
    """Send a request head a byte every 0.1 s; what the server answered, and when it closed."""
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\n" + b"x-slow: " + b"a" * 200
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        started = time.monotonic()
        sock.settimeout(0.1)
        answer = b""
        for byte in head:
            if stop.is_set():
                break
            try:
                sock.send(bytes([byte]))
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if not chunk:  # closed by the server
                break
            answer += chunk
        return answer, time.monotonic() - started


def test_a_request_head_that_dribbles_in_gets_408_and_health_answers_throughout(limited):
    stop = threading.Event()
    outcome: list[tuple[bytes, float]] = []
    loris = threading.Thread(target=lambda: outcome.append(dribble_headers(limited.url, stop)))
    loris.start()
    try:
        with httpx.Client(base_url=limited.url, timeout=5) as client:
            for _ in range(10):
                assert client.get("/health").status_code == 200
                time.sleep(0.1)
    finally:
        loris.join(15)
        stop.set()
    answer, seconds = outcome[0]
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1 s" in answer
    assert seconds < 3  # a 1 s deadline, not the 20 s the head would take


def test_a_connection_that_sends_nothing_is_closed(limited):
    host, port = limited.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        started = time.monotonic()
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 3
        assert sock.recv(4096) == b""  # and closed
