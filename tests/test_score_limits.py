"""A score cannot monopolise the engine: its continuations go to the engine a batch at a time
(full logprob rows are read and dropped batch by batch, other requests come in between), a
call has a cap on continuations, and over HTTP a score counts against the caller's requests
in flight."""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest
import torch
from conftest import ServerThread

from runtime import scoring
from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.protocol import ScoreRequest

PREFIX = list(range(300, 340))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)) as eng:
        yield eng


def continuations(num: int) -> list[list[int]]:
    """Two tokens each, no two with the same first token."""
    return [[500 + i, 700 + i] for i in range(num)]


def test_a_score_holds_logprob_rows_for_one_batch_at_a_time(engine, monkeypatch):
    conts = continuations(40) + [[500, 900]]  # shares its first token with the first
    (whole,) = engine.score(ScoreRequest(prefix=PREFIX, continuations=conts))
    monkeypatch.setattr(scoring, "MAX_SCORE_BATCH", 8)
    scorer, seen, held = engine.scorer, [], []
    run = scorer._run

    def counting_run(reqs):
        run(reqs)
        seen.extend(reqs)
        held.append(sum(r.logprobs.last is not None for r in seen))  # full vocabulary rows

    monkeypatch.setattr(scorer, "_run", counting_run)
    (batched,) = engine.score(ScoreRequest(prefix=PREFIX, continuations=conts))
    # the first and last come whole from pins (the prefix, and their shared first token);
    # the 39 others in 5 engine runs of at most 8: rows never outnumber one batch
    assert len(seen) == 39 and len(held) == 5 and max(held) <= 8
    assert all(r.logprobs.last is None and not r.logprobs.values for r in seen)
    for a, b in zip(whole.token_logprobs, batched.token_logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert engine.stats()["num_pins"] == 0


def test_a_pinned_node_keeps_only_the_tokens_scored_after_it():
    row = torch.log_softmax(torch.randn(49152), dim=-1)
    conts = [[5, 6, 7], [5, 6, 8], [5, 9], [4, 6]]
    kept = scoring._next_logprobs(row, (5, 6), conts)
    assert kept == {7: float(row[7]), 8: float(row[8])}
    assert set(scoring._next_logprobs(row, (), conts)) == {4, 5}


def test_a_score_past_the_continuation_cap_is_refused(engine):
    conts = [[5]] * (scoring.MAX_SCORE_CONTINUATIONS + 1)
    with pytest.raises(InvalidRequestError, match="1,025 continuations exceeds the limit of 1,024"):
        engine.score(ScoreRequest(prefix=PREFIX, continuations=conts))


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096))
    thread = ServerThread(engine, api_keys=("user-key",), max_requests_per_key=2)
    yield thread
    thread.stop()


AUTH = {"Authorization": "Bearer user-key"}


def test_the_cap_is_a_400_naming_it(server):
    body = {"prefix": PREFIX, "continuations": [[5]] * 1025}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response = client.post("/v1/flowlang/score", json=body, headers=AUTH)
    assert response.status_code == 400
    assert "exceeds the limit of 1,024" in response.json()["error"]["message"]


def test_a_score_counts_against_the_requests_in_flight(server):
    state = server.app.state.server
    tenant = state.keys["user-key"]
    long = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 1500}}
    long["sampling_params"] |= {"ignore_eos": True, "temperature": 0}
    with contextlib.ExitStack() as streams, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):  # the tenant's whole limit
            response = streams.enter_context(
                client.stream("POST", "/generate", json=long, headers=AUTH)
            )
            assert response.status_code == 200
        refused = client.post(
            "/v1/flowlang/score", json={"prefix": PREFIX, "continuations": [[5]]}, headers=AUTH
        )
        assert refused.status_code == 429, refused.text
        assert "2 requests in flight (limit 2)" in refused.json()["error"]["message"]
    gone = threading.Event()
    for _ in range(400):  # the streams closed: their requests are aborted and released
        if state.inflight[tenant] == 0:
            gone.set()
            break
        gone.wait(0.05)
    assert gone.is_set()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        ok = client.post(
            "/v1/flowlang/score",
            json={"prefix": PREFIX, "continuations": [[5], [6, 7]]},
            headers=AUTH,
        )
    assert ok.status_code == 200 and len(ok.json()["token_logprobs"]) == 2
    assert state.inflight[tenant] == 0  # given back when the score finished
