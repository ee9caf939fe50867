"""Tenants on one server (one per API key) see nothing of each other: request ids are theirs
alone (reused freely, never aborted or confirmed across keys), the pin quota holds under
concurrent pins, the dashboard shows a tenant its own namespaces and pins only, and idle KV
event followers hold no worker threads."""

from __future__ import annotations

import json
import threading
import time
import xml.etree.ElementTree as ET

import httpx
import pytest
from conftest import ServerThread
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.events import KVEventSubscription
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import RequestError
from runtime.handles import PinHandle
from runtime.protocol import PinInfo
from runtime.server.errors import TooManyRequestsError
from runtime.server.pins import PinLeases

A, B, ADMIN = "key-a", "key-b", "key-admin"
QUOTA_TOKENS = 300
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def tenants(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    server = ServerThread(
        engine,
        api_keys=(A, B),
        admin_keys=(ADMIN,),
        max_pinned_tokens_per_key=QUOTA_TOKENS,
        max_kv_followers_per_key=64,
    )
    yield server
    server.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tag(server: ServerThread, key: str) -> str:
    return server.app.state.server.keys[key]


def wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def frames(stream: httpx.Response):
    """The JSON data frames of an SSE response."""
    for line in stream.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


# ---------------------------------------------------------------- request ids


def test_request_ids_are_per_tenant(tenants):
    """B may reuse an id A has in flight and gets its own answer under it; B's abort of it is
    the same 404 as for an id nobody uses, and A's request runs on until A aborts it."""
    with httpx.Client(base_url=tenants.url, timeout=120) as client:
        longer = {**LONG, "max_new_tokens": 3000}  # runs on while B and A make five calls
        body = {"input_ids": [5, 6, 7], "rid": "job-1", "stream": True, "sampling_params": longer}
        with client.stream("POST", "/generate", json=body, headers=auth(A)) as stream:
            assert stream.status_code == 200
            a_frames = frames(stream)
            first = next(a_frames)
            assert first["meta_info"]["id"] == "job-1"

            short = {"input_ids": [9, 9], "rid": "job-1", "sampling_params": {"max_new_tokens": 3}}
            mine = client.post("/generate", json=short, headers=auth(B))
            assert mine.status_code == 200, mine.text
            assert mine.json()["meta_info"]["id"] == "job-1"
            assert mine.json()["meta_info"]["finish_reason"]["type"] == "length"

            again = client.post("/generate", json=short, headers=auth(A))
            assert again.status_code == 400
            message = again.json()["error"]["message"]
            assert "'job-1' is already in flight" in message
            assert tag(tenants, A) not in message

            nobody = client.post("/abort_request", json={"rid": "nobody-uses"}, headers=auth(B))
            theirs = client.post("/abort_request", json={"rid": "job-1"}, headers=auth(B))
            assert nobody.status_code == theirs.status_code == 404
            assert theirs.json()["error"]["message"] == nobody.json()["error"]["message"].replace(
                "nobody-uses", "job-1"
            )

            # A's request runs on: its output keeps growing after B's abort
            seen = len(first["output_ids"])
            grown = next(f for f in a_frames if len(f["output_ids"]) > seen + 2)
            assert grown["meta_info"]["finish_reason"] is None
            stopped = client.post("/abort_request", json={"rid": "job-1"}, headers=auth(A))
            assert stopped.status_code == 200 and stopped.json()["rid"] == "job-1"
            last = list(a_frames)
        assert last[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert last[-1]["meta_info"]["id"] == "job-1"
    assert wait_for(lambda: tenants.engine.stats()["num_running"] == 0)


def test_flowlang_generate_answers_under_the_clients_own_id(tenants):
    body = {"input_ids": [3, 4, 5], "rid": "own-id", "sampling": {"max_new_tokens": 2}}
    with httpx.Client(base_url=tenants.url, timeout=60) as client:
        response = client.post("/v1/flowlang/generate", json=body, headers=auth(B))
        assert response.status_code == 200, response.text
        events = [f for f in frames(response)]
    assert events[-1]["result"]["rid"] == "own-id"


def test_abort_all_stops_only_the_callers_requests(tenants):
    with httpx.Client(base_url=tenants.url, timeout=120) as client:
        body = {"input_ids": [8, 8, 8], "rid": "long", "stream": True, "sampling_params": LONG}
        with (
            client.stream("POST", "/generate", json=body, headers=auth(A)) as a_stream,
            client.stream("POST", "/generate", json=body, headers=auth(B)) as b_stream,
        ):
            a_frames, b_frames = frames(a_stream), frames(b_stream)
            next(a_frames), next(b_frames)
            stopped = client.post("/abort_request", json={"abort_all": True}, headers=auth(B))
            assert stopped.status_code == 200 and stopped.json()["rids"] == ["long"]
            assert list(b_frames)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            first = next(a_frames)
            grown = next(f for f in a_frames if len(f["output_ids"]) > len(first["output_ids"]))
            assert grown["meta_info"]["finish_reason"] is None
            client.post("/abort_request", json={"rid": "long"}, headers=auth(A))
            assert list(a_frames)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert wait_for(lambda: tenants.engine.stats()["num_running"] == 0)


def test_without_keys_a_client_aborts_its_request_by_id(served):
    with httpx.Client(base_url=served.url, timeout=120) as client:
        body = {"input_ids": [4, 4, 4], "rid": "solo", "stream": True, "sampling_params": LONG}
        with client.stream("POST", "/generate", json=body) as stream:
            solo = frames(stream)
            assert next(solo)["meta_info"]["id"] == "solo"
            assert client.post("/abort_request", json={"rid": "solo"}).status_code == 200
            last = list(solo)
        assert last[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        lone_surrogate = b'{"rid": "\\ud800"}'  # JSON's escape: httpx cannot encode it
        unknown = client.post(
            "/abort_request", content=lone_surrogate, headers={"content-type": "application/json"}
        )
        assert unknown.status_code == 404 and "no request" in unknown.json()["error"]["message"]
    assert wait_for(lambda: served.engine.stats()["num_running"] == 0)


# ---------------------------------------------------------------- pins


OWNERS = ("a", "b")
PIN_STEPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "prefilled", "failed", "release"]),
        st.sampled_from(OWNERS),
        st.integers(1, 120),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(PIN_STEPS)
def test_pin_reservations_never_take_an_owner_past_its_quota(steps):
    """Against a model: a reservation passes exactly when the owner's leases, its pending
    reservations and the new one fit the quota; a prefilled pin turns its reservation into a
    lease, a failed one gives it back, and a release frees the lease's tokens."""
    quota = 300
    leases = PinLeases(engine=None, max_tokens_per_owner=quota)
    pending: dict[str, list[int]] = {o: [] for o in OWNERS}
    held: dict[str, list[PinHandle]] = {o: [] for o in OWNERS}
    for k, (step, owner, num_tokens) in enumerate(steps):
        used = sum(pending[owner]) + sum(h.info.num_tokens for h in held[owner])
        if step == "reserve":
            fits = used + num_tokens <= quota
            try:
                leases.reserve(owner, num_tokens)
            except TooManyRequestsError as err:
                assert not fits and f"({used} held)" in str(err)
            else:
                assert fits
                pending[owner].append(num_tokens)
        elif step == "prefilled" and pending[owner]:
            reserved = pending[owner].pop()
            info = PinInfo(pin_id=f"pin-{k}", num_tokens=reserved, cached_tokens=0)
            handle = PinHandle(info, lambda _: None)
            leases.add(handle, owner, None, reserved_tokens=reserved)
            held[owner].append(handle)
        elif step == "failed" and pending[owner]:
            leases.unreserve(owner, pending[owner].pop())
        elif step == "release" and held[owner]:
            leases.release(held[owner].pop().pin_id, owner)
    for owner in OWNERS:  # what is left fits, and exactly the rest of the quota is free
        used = sum(pending[owner]) + sum(h.info.num_tokens for h in held[owner])
        assert used <= quota
        if used < quota:
            leases.reserve(owner, quota - used)
        with pytest.raises(TooManyRequestsError):
            leases.reserve(owner, 1)


def test_concurrent_pins_hold_the_quota(tenants, monkeypatch):
    """Four pins of 100 tokens at once against a 300-token quota: three pass, one is a 429;
    every prefill is held until all four have been answered or admitted, so none of them
    can see another's lease before its own check."""
    engine = tenants.engine
    real_pin = engine.pin
    entered, answered = [], []
    release = threading.Event()

    def held_pin(*args, **kwargs):
        entered.append(1)
        release.wait(60)
        return real_pin(*args, **kwargs)

    monkeypatch.setattr(engine, "pin", held_pin)
    responses: list[httpx.Response] = []

    def pin(k: int) -> None:
        prefix = list(range(1000 + 100 * k, 1100 + 100 * k))
        body = {"prefix_ids": prefix, "lease_seconds": 600}
        response = httpx.post(
            f"{tenants.url}/v1/flowlang/pin", json=body, headers=auth(A), timeout=120
        )
        responses.append(response)
        answered.append(1)

    threads = [threading.Thread(target=pin, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    assert wait_for(lambda: len(entered) + len(answered) >= 4)
    release.set()
    for thread in threads:
        thread.join(120)
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200, 200, 200, 429], [r.text for r in responses]
    refused = next(r for r in responses if r.status_code == 429)
    assert f"quota of {QUOTA_TOKENS} pinned tokens" in refused.json()["error"]["message"]
    with httpx.Client(base_url=tenants.url, timeout=60) as client:
        for response in responses:
            if response.status_code == 200:
                pin_id = response.json()["pin_id"]
                assert client.delete(f"/v1/flowlang/pin/{pin_id}", headers=auth(A)).is_success
        # the quota is whole again: nothing stays reserved by the refused or released pins
        whole = client.post(
            "/v1/flowlang/pin",
            json={"prefix_ids": list(range(2000, 2000 + QUOTA_TOKENS))},
            headers=auth(A),
        )
        assert whole.status_code == 200, whole.text
        assert client.delete(f"/v1/flowlang/pin/{whole.json()['pin_id']}", headers=auth(A))


def test_a_failed_pin_gives_its_reservation_back(tenants, monkeypatch):
    def broken_pin(*args, **kwargs):
        raise RequestError("the prefill broke")

    monkeypatch.setattr(tenants.engine, "pin", broken_pin)
    body = {"prefix_ids": list(range(1, 1 + QUOTA_TOKENS))}
    with httpx.Client(base_url=tenants.url, timeout=60) as client:
        for _ in range(2):
            assert client.post("/v1/flowlang/pin", json=body, headers=auth(B)).status_code == 500
        monkeypatch.undo()
        whole = client.post("/v1/flowlang/pin", json=body, headers=auth(B))
        assert whole.status_code == 200, whole.text
        assert client.delete(f"/v1/flowlang/pin/{whole.json()['pin_id']}", headers=auth(B))


# ---------------------------------------------------------------- dashboard


def test_the_dashboard_shows_a_tenant_only_its_own(tenants):
    a_tag = tag(tenants, A)
    with httpx.Client(base_url=tenants.url, timeout=60) as client:
        body = {
            "input_ids": list(range(300, 340)),
            "sampling_params": {"max_new_tokens": 2},
            "cache_salt": "secret-salt",
        }
        assert client.post("/generate", json=body, headers=auth(A)).status_code == 200
        pinned = client.post(
            "/v1/flowlang/pin",
            json={"prefix_ids": list(range(400, 450)), "namespace": "pinned-salt"},
            headers=auth(A),
        )
        assert pinned.status_code == 200, pinned.text
        pin_id = pinned.json()["pin_id"]
        try:
            short = {"input_ids": list(range(500, 530)), "sampling_params": {"max_new_tokens": 2}}
            assert client.post("/generate", json=short, headers=auth(B)).status_code == 200
            seen_by_b = client.get("/dashboard/data", headers=auth(B))
            seen_by_admin = client.get("/dashboard/data", headers=auth(ADMIN)).json()
        finally:
            client.delete(f"/v1/flowlang/pin/{pin_id}", headers=auth(A))
    text = seen_by_b.text
    for secret in (a_tag, "secret-salt", "pinned-salt", pin_id):
        assert secret not in text, secret
    tree = seen_by_b.json()["tree"]
    assert tree["pins"] == []
    headings = [t.text or "" for t in ET.fromstring(tree["svg"]).iter() if t.text]
    assert not any("namespace" in h and tag(tenants, B) not in h for h in headings), headings
    admin_text = json.dumps(seen_by_admin)
    assert pin_id in admin_text and a_tag in admin_text and "secret-salt" in admin_text


# ---------------------------------------------------------------- KV event followers


def test_idle_kv_event_followers_hold_no_worker_threads(tenants, monkeypatch):
    """24 idle followers: none of them waits in a worker thread (the stream polls on the
    event loop), other routes answer, and an event still reaches every follower."""
    num_followers = 24
    lock = threading.Lock()
    inside = {"now": 0, "most": 0, "calls": 0}
    real_poll = KVEventSubscription.poll

    def counted_poll(self, *args, **kwargs):
        with lock:
            inside["now"] += 1
            inside["calls"] += 1
            inside["most"] = max(inside["most"], inside["now"])
        try:
            return real_poll(self, *args, **kwargs)
        finally:
            with lock:
                inside["now"] -= 1

    monkeypatch.setattr(KVEventSubscription, "poll", counted_poll)
    clients = [httpx.Client(base_url=tenants.url, timeout=60) for _ in range(num_followers)]
    streams = []
    try:
        for c in clients:
            stream = c.stream("GET", "/v1/flowlang/kv_events", headers=auth(ADMIN))
            response = stream.__enter__()
            streams.append((stream, response.iter_lines()))
            assert response.status_code == 200
        for _, lines in streams:
            assert "snapshot" in json.loads(next(lines))
        # every follower has polled a few times while idle
        assert wait_for(lambda: inside["calls"] >= 4 * num_followers)
        assert inside["most"] <= 1, f"{inside['most']} followers waited in threads at once"
        with httpx.Client(base_url=tenants.url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            ids = client.post("/v1/flowlang/tokenize", json={"text": "hi"}, headers=auth(A))
            assert ids.status_code == 200
            body = {"input_ids": list(range(700, 720)), "sampling_params": {"max_new_tokens": 1}}
            assert client.post("/generate", json=body, headers=auth(A)).status_code == 200
        for _, lines in streams:
            assert "seq" in json.loads(next(lines))
    finally:
        for stream, _ in streams:
            stream.__exit__(None, None, None)
        for c in clients:
            c.close()
    server = tenants.app.state.server
    assert wait_for(lambda: server.num_kv_followers() == 0)


def test_kv_event_followers_past_the_cap_get_429(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, api_keys=(A,), admin_keys=(ADMIN,), max_kv_followers_per_key=2)
    try:
        with httpx.Client(base_url=thread.url, timeout=60) as client:
            route = "/v1/flowlang/kv_events"
            with (
                client.stream("GET", route, headers=auth(ADMIN)) as one,
                client.stream("GET", route, headers=auth(ADMIN)) as two,
            ):
                assert one.status_code == two.status_code == 200
                third = client.get(route, headers=auth(ADMIN))
                assert third.status_code == 429
                assert "2 KV event followers (limit 2)" in third.json()["error"]["message"]
            server = thread.app.state.server
            assert wait_for(lambda: server.num_kv_followers() == 0)
            with client.stream("GET", route, headers=auth(ADMIN)) as again:
                assert again.status_code == 200
    finally:
        thread.stop()
