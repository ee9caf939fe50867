"""Grammar compiles never delay unconstrained requests: they run on a queue of their own that
tenants take turns on, a tenant may have only a few queued (429 beyond), and the server awaits
them without holding the threads that submit requests."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import ServerThread

from runtime.config import EngineConfig
from runtime.constrain import compile_queue
from runtime.constrain.compile_queue import CompileQueue, CompileQueueFullError
from runtime.engine import Engine
from runtime.errors import InvalidRequestError

KEYS = tuple(f"key-{i}" for i in range(6))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- the queue
def test_tenants_take_turns_and_each_has_a_cap():
    queue = CompileQueue(max_per_tenant=3)
    started, gate, order = threading.Event(), threading.Event(), []

    def job(name):
        def run():
            if name == "a0":
                started.set()
                gate.wait(30)
            order.append(name)
            return name

        return run

    futures = [queue.submit("a", job(f"a{i}")) for i in range(3)]
    assert started.wait(30)
    with pytest.raises(CompileQueueFullError, match=r"3 grammar compiles .*\(limit 3\)"):
        queue.submit("a", job("a3"))
    futures += [queue.submit("b", job("b0")), queue.submit("c", job("c0"))]
    gate.set()
    assert [f.result(30) for f in futures] == ["a0", "a1", "a2", "b0", "c0"]
    # a0 was running when the others came; then each tenant in turn
    assert order == ["a0", "a1", "b0", "c0", "a2"]
    assert queue.num_jobs("a") == 0 and queue.submit("a", job("a4")).result(30) == "a4"


def test_a_failed_job_fails_its_future_and_frees_its_place():
    queue = CompileQueue(max_per_tenant=1)

    def bad():
        raise InvalidRequestError("invalid regex: nope")

    with pytest.raises(InvalidRequestError, match="nope"):
        queue.submit("a", bad).result(30)
    assert queue.submit("a", lambda: 1).result(30) == 1


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, api_keys=KEYS)
    yield thread
    thread.stop()


@pytest.fixture
def blocked_compiles(server, monkeypatch):
    """Every compile waits until the test sets the returned event (then fails as invalid);
    `entered` counts compiles begun."""
    release = threading.Event()
    entered = []

    def slow_compile(constraint, tenant=None):
        entered.append(constraint.regex)
        assert release.wait(120), "the test never released the compiles"
        raise InvalidRequestError(f"invalid regex: {constraint.regex} (a fake compile)")

    monkeypatch.setattr(server.engine.intake, "_compiled", slow_compile)
    yield release, entered
    release.set()


def wait_for(condition, release: threading.Event, timeout_s: float = 60.0) -> None:
    """Wait until `condition()` holds (the compiles still blocked meanwhile)."""
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        assert not release.wait(0.05)
    raise AssertionError("the condition never held")


def constrained(i: int) -> dict:
    regex = f"( ?[a-z]+){{1,{i + 2}}}\\."  # distinct: each its own compile
    return {"text": "Hi", "sampling_params": {"regex": regex, "max_new_tokens": 4}}


def test_an_unconstrained_request_is_served_while_compiles_fill_the_queue(server, blocked_compiles):
    release, entered = blocked_compiles
    # more constrained requests than the event loop has worker threads (32 at most), each key
    # at its limit of queued compiles
    num_constrained = compile_queue.MAX_QUEUED_COMPILES_PER_TENANT * (len(KEYS) - 1)

    def post_constrained(i: int) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=180) as client:
            return client.post("/generate", json=constrained(i), headers=auth(KEYS[i % 5]))

    with ThreadPoolExecutor(num_constrained) as pool:
        waiting = [pool.submit(post_constrained, i) for i in range(num_constrained)]
        inflight = server.app.state.server.inflight
        wait_for(lambda: sum(inflight.values()) == num_constrained and entered, release)
        with httpx.Client(base_url=server.url, timeout=60) as client:
            plain = client.post(
                "/generate",
                json={"text": "Hi", "sampling_params": {"max_new_tokens": 3}},
                headers=auth(KEYS[5]),
            )
        assert plain.status_code == 200, plain.text
        assert len(entered) == 1 and not release.is_set()  # the compiles are still blocked
        release.set()
        statuses = [w.result(180).status_code for w in waiting]
    assert statuses == [400] * num_constrained


def test_a_tenant_past_its_queued_compiles_gets_429_and_others_still_compile(
    server, blocked_compiles, monkeypatch
):
    release, _ = blocked_compiles
    monkeypatch.setattr(compile_queue, "MAX_QUEUED_COMPILES_PER_TENANT", 2)

    def post(i: int, key: str) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=180) as client:
            return client.post("/generate", json=constrained(i), headers=auth(key))

    with ThreadPoolExecutor(4) as pool:
        first = [pool.submit(post, i, KEYS[0]) for i in range(2)]
        queue = server.engine.intake.compile_queue
        tenant = server.app.state.server.keys[KEYS[0]]
        wait_for(lambda: queue.num_jobs(tenant) == 2, release)
        refused = post(2, KEYS[0])
        assert refused.status_code == 429, refused.text
        assert "2 grammar compiles queued or running (limit 2)" in refused.text
        other = pool.submit(post, 3, KEYS[1])  # another tenant: queued, not refused
        release.set()
        assert other.result(180).status_code == 400
        assert [f.result(180).status_code for f in first] == [400, 400]
    assert queue.num_jobs(tenant) == 0
