"""The OpenAI Batch API on `flowlang serve` (/v1/files, /v1/batches), through the real `openai`
client: a batch's lines answered exactly as the same requests over HTTP, each custom_id in
exactly one of the output and error files, cancel, tenants, and a batch resumed by the next
server on the same directory without running a finished line again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from conftest import ServerThread

openai = pytest.importorskip("openai")

KEYS = ("key-a", "key-b")
SYSTEM = "You are a helpful assistant who answers briefly and precisely. " * 6
FINAL = ("completed", "failed", "expired", "cancelled")


def _engine(tiny_model_dir):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    return Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=20_000))


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """The tiny model behind a server with two API keys (two tenants)."""
    folder = tmp_path_factory.mktemp("batches")
    thread = ServerThread(_engine(tiny_model_dir), api_keys=KEYS, batch_dir=str(folder))
    yield thread
    thread.stop()


def client(server, key: str = KEYS[0]):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def chat_body(i: int, max_tokens: int = 8) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Q{i}?"}]
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0}


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def upload(api, tmp_path: Path, lines: list[str]):
    path = tmp_path / f"in-{time.monotonic_ns()}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as data:
        return api.files.create(file=data, purpose="batch")


def create(api, file_id: str, endpoint: str = "/v1/chat/completions", **options):
    return api.batches.create(
        input_file_id=file_id, endpoint=endpoint, completion_window="24h", **options
    )


def wait(api, batch_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (batch := api.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)
    return batch


def get(server, path: str, key: str = KEYS[0]) -> httpx.Response:
    return httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"})


def results(api, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(t) for t in api.files.content(file_id).text.splitlines() if t.strip()]


def test_batch_answers_like_http_and_reports_bad_lines(server, tmp_path):
    api = client(server)
    lines = [line(f"chat-{i}", chat_body(i)) for i in range(6)]
    lines += [
        line("other-url", {"prompt": "Hi", "max_tokens": 4}, "/v1/completions"),
        "not json",
        line("bad-body", {"messages": [], "max_tokens": -5}),
        line("chat-0", chat_body(0)),  # repeats a custom_id
    ]
    uploaded = upload(api, tmp_path, lines)
    assert (uploaded.object, uploaded.purpose, uploaded.status) == ("file", "batch", "processed")
    assert api.files.retrieve(uploaded.id).bytes == uploaded.bytes > 0
    batch = create(api, uploaded.id, metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    batch = wait(api, batch.id)
    assert batch.status == "completed", batch
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (10, 6, 4)
    output, errors = results(api, batch.output_file_id), results(api, batch.error_file_id)
    assert api.files.retrieve(batch.output_file_id).purpose == "batch_output"
    ids = sorted(str(r["custom_id"]) for r in output + errors)  # the line not JSON: None
    expected = [*(f"chat-{i}" for i in range(6)), "other-url", "None", "bad-body", "chat-0"]
    assert ids == sorted(expected)
    assert len({r["id"] for r in output + errors}) == 10
    by_id = {r["custom_id"]: r for r in errors}
    assert "/v1/chat/completions" in by_id["other-url"]["error"]["message"]
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [], "max_tokens": -5},
        headers={"Authorization": f"Bearer {KEYS[0]}"},
    )
    assert by_id["bad-body"]["response"]["status_code"] == bad.status_code >= 400
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in output)
    for record in output:  # greedy: the batch's answer is the one HTTP gives
        i = int(record["custom_id"].split("-")[1])
        direct = api.chat.completions.create(model=server.engine.config.model, **chat_body(i))
        answer = record["response"]["body"]["choices"][0]["message"]["content"]
        assert answer == direct.choices[0].message.content
    assert batch.id in [b.id for b in api.batches.list()]


def test_completions_batch_and_metrics(server, tmp_path):
    api = client(server)
    prompts = [SYSTEM + f"Item {i}:" for i in range(4)]
    lines = [
        line(f"c{i}", {"prompt": p, "max_tokens": 6}, "/v1/completions")
        for i, p in enumerate(prompts)
    ]
    batch = wait(api, create(api, upload(api, tmp_path, lines).id, "/v1/completions").id)
    assert batch.status == "completed" and batch.error_file_id is None
    output = results(api, batch.output_file_id)
    assert sorted(r["custom_id"] for r in output) == ["c0", "c1", "c2", "c3"]
    direct = api.completions.create(
        model=server.engine.config.model, prompt=prompts[2], max_tokens=6, temperature=0
    )
    assert isinstance(direct.choices[0].text, str)
    text = get(server, "/metrics").text
    assert 'flowlang_batch_lines{state="completed"}' in text
    assert "flowlang_batch_prefill_saved_tokens" in text
    assert 'flowlang_batches{status="completed"}' in text


def test_cancel_stops_lines_not_started(server, tmp_path):
    api = client(server)
    lines = [line(f"r{i}", chat_body(i, max_tokens=32)) for i in range(300)]
    batch = create(api, upload(api, tmp_path, lines).id)
    rows = get(server, "/dashboard/data").json()["batches"]
    assert batch.id in [row["id"] for row in rows]
    assert get(server, "/dashboard/data", KEYS[1]).json()["batches"] == []  # another tenant's
    cancelled = api.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    batch = wait(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = results(api, batch.output_file_id) + results(api, batch.error_file_id)
    assert len(done) == batch.request_counts.completed + batch.request_counts.failed < 300
    assert len({r["custom_id"] for r in done}) == len(done)
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        api.batches.cancel(batch.id)


def test_tenants_see_only_their_own(server, tmp_path):
    owner, other = client(server, KEYS[0]), client(server, KEYS[1])
    uploaded = upload(owner, tmp_path, [line("x", chat_body(1))])
    batch = wait(owner, create(owner, uploaded.id).id)
    assert batch.status == "completed"
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(batch.output_file_id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: create(other, uploaded.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [b.id for b in other.batches.list()]
    assert uploaded.id not in [f.id for f in other.files.list()]
    assert owner.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(uploaded.id)


def test_a_file_of_megabytes_uploads_within_the_default_body_limit(server, tmp_path):
    api = client(server)
    lines = [
        line(f"l{i}", {"messages": [{"role": "user", "content": "x" * 3000}]}) for i in range(1000)
    ]
    uploaded = upload(api, tmp_path, lines)
    assert uploaded.bytes > 3_000_000
    assert api.files.content(uploaded.id).text == "\n".join(lines) + "\n"
    assert uploaded.id in [f.id for f in api.files.list(purpose="batch")]
    assert api.files.delete(uploaded.id).deleted


def test_bad_requests_name_the_field(server, tmp_path):
    api = client(server)
    path = tmp_path / "in.jsonl"
    path.write_text(line("a", chat_body(1)) + "\n")
    with path.open("rb") as data, pytest.raises(openai.BadRequestError, match="purpose"):
        api.files.create(file=data, purpose="fine-tune")
    file_id = upload(api, tmp_path, [line("a", chat_body(1))]).id
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        create(api, file_id, "/v1/embeddings")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        api.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="48h"
        )
    with pytest.raises(openai.BadRequestError, match="metadata"):
        create(api, file_id, metadata={"k" * 65: "v"})
    with pytest.raises(openai.NotFoundError, match="input_file_id"):
        create(api, "file-" + "0" * 24)


def test_a_restarted_server_resumes_without_rerunning(tiny_model_dir, tmp_path):
    """A drain (SIGTERM) mid-batch: lines not started are left, none answered 503; the stop
    cuts off those still running (drain_timeout 0); the next server runs only the rest."""
    folder = str(tmp_path / "batches")
    first = ServerThread(_engine(tiny_model_dir), batch_dir=folder, drain_timeout=0.0)
    num_lines = 300
    lines = [line(f"r{i}", chat_body(i, max_tokens=24)) for i in range(num_lines)]
    try:
        api = client(first)
        batch = create(api, upload(api, tmp_path, lines).id)
        output = Path(folder) / "batches" / f"{batch.id}.output.jsonl"
        deadline = time.monotonic() + 60
        while not output.exists() or len(output.read_bytes().splitlines()) < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        first.app.state.drain.begin("SIGTERM", time.monotonic())
        time.sleep(0.3)
    finally:
        first.stop()
    num_done = len(output.read_bytes().splitlines())
    assert 5 <= num_done < num_lines, "the batch ended before the server stopped"
    stored = json.loads((Path(folder) / "batches" / f"{batch.id}.json").read_text())
    assert stored["batch"]["status"] == "in_progress"
    errors = Path(folder) / "batches" / f"{batch.id}.errors.jsonl"
    assert not errors.exists() or not errors.read_bytes(), "a line was answered 503"
    second = ServerThread(_engine(tiny_model_dir), batch_dir=folder)
    try:
        api = client(second)
        batch = wait(api, batch.id)
        assert batch.status == "completed" and batch.request_counts.completed == num_lines
        assert batch.error_file_id is None
        ids = [r["custom_id"] for r in results(api, batch.output_file_id)]
        assert sorted(ids) == sorted(f"r{i}" for i in range(num_lines))
        ran_here = second.app.state.server.http_requests["/v1/chat/completions"]
        assert ran_here == num_lines - num_done
    finally:
        second.stop()
