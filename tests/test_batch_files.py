"""Batch files offline: lines checked one by one, results durable line by line, `flowlang
batch` on a mix of chat, completion and program lines, a run killed with SIGKILL and resumed
(every custom_id once, outputs identical, finished lines prefill nothing), run_batch(results=),
and registered programs over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flowlang import gen, program
from flowlang.backends.mock import MockBackend
from flowlang.batch_results import RecordedRun
from runtime.batches.lines import parse_lines
from runtime.batches.results_file import ResultsFile, ResultsFileError, result_record

URLS = ["/v1/chat/completions", "/v1/completions"]
ROOT = Path(__file__).resolve().parents[1]


def line(custom_id, body, url="/v1/completions", **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body} | extra)


def test_each_bad_line_is_its_own_error_and_ids_ignore_key_order():
    lines = [
        line("a", {"prompt": "x", "max_tokens": 2}),
        '{"custom_id": "b", "method": "POST"',
        "[1, 2]",
        line("", {"prompt": "x"}),
        line("a", {"prompt": "y"}),  # repeats line 1
        json.dumps({"custom_id": "c", "method": "GET", "url": URLS[1], "body": {}}),
        line("d", {"prompt": "x"}, url="/v1/embeddings"),
        json.dumps({"custom_id": "e", "method": "POST", "url": URLS[1], "body": [1]}),
        line("f", {"prompt": "x", "stream": True}),
        line("g", {"prompt": "x"}, extra_field=1),
        "",
        json.dumps(
            {
                "body": {"max_tokens": 2, "prompt": "x"},
                "url": URLS[1],
                "method": "POST",
                "custom_id": "h",
            }
        ),
    ]
    parsed = parse_lines(lines, URLS)
    assert [ln.custom_id for ln in parsed.lines] == ["a", "h"]
    messages = [b.message for b in parsed.bad]
    assert [b.number for b in parsed.bad] == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    for needle in (
        "not JSON",
        "not a JSON object",
        "custom_id must be",
        "repeats line 1",
        "method must be 'POST'",
        "'/v1/embeddings' is not one of",
        "body must be",
        "streamed",
        "unknown field(s) 'extra_field'",
    ):
        assert any(needle in m for m in messages), (needle, messages)
    assert parsed.bad[3].custom_id == "a"  # the repeat still reports under its custom_id
    # the same body in another key order is the same line (one id): a rerun recognises it
    again = parse_lines([line("h", {"prompt": "x", "max_tokens": 2})], URLS).lines[0]
    assert again.id == parsed.lines[1].id
    edited = parse_lines([line("h", {"prompt": "x", "max_tokens": 3})], URLS).lines[0]
    assert edited.id != again.id


def test_results_file_cuts_a_torn_line_and_refuses_a_foreign_file(tmp_path):
    path = tmp_path / "out.jsonl"
    with ResultsFile(path) as results:
        results.append(result_record(("a", "batch_req_1"), 200, {"ok": 1}, "r1"))
        results.append(result_record(("b", "batch_req_2"), 400, {"error": {"message": "no"}}, "r2"))
    with path.open("ab") as torn:  # a crash in the middle of the third write
        torn.write(b'{"id": "batch_req_3", "custom_id": "c", "respo')
    with ResultsFile(path) as results:
        assert results.done == {("a", "batch_req_1"), ("b", "batch_req_2")}
        results.append(result_record(("c", "batch_req_3"), 200, {}, "r3"))
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", "b", "c"]
    assert records[1]["error"] == {"code": "400", "message": "no"}
    foreign = tmp_path / "notes.jsonl"
    foreign.write_text('{"hello": 1}\n')
    with pytest.raises(ResultsFileError, match="line 1 is not a batch result"):
        ResultsFile(foreign)


# ------------------------------------------------------------------ run_batch(results=)


@program
def haiku(s, topic: str, lines: int = 1):
    s += f"A poem about {topic}:"
    for i in range(lines):
        s += gen(f"line_{i}", max_new_tokens=3)
    return {"topic": topic}


def test_run_batch_results_skip_what_is_done_and_rerun_what_changed(tmp_path):
    path = tmp_path / "runs.jsonl"
    batch = [{"topic": t} for t in ("sea", "hill", "rain")]
    first_backend = MockBackend()
    first = haiku.run_batch(batch, backend=first_backend, progress=False, results=path)
    assert len(first_backend.requests) == 3
    backend = MockBackend()
    again = haiku.run_batch(batch, backend=backend, progress=False, results=path)
    assert backend.requests == []  # nothing recomputed
    assert all(isinstance(r, RecordedRun) for r in again)
    assert [r["line_0"] for r in again] == [s["line_0"] for s in first]
    assert again[1].return_value == {"topic": "hill"}
    changed = [{"topic": "sea"}, {"topic": "hill", "lines": 2}, {"topic": "rain"}]
    backend = MockBackend()
    third = haiku.run_batch(changed, backend=backend, progress=False, results=path)
    assert len(backend.requests) == 2 and not isinstance(third[1], RecordedRun)
    assert len(path.read_text().splitlines()) == 4  # nothing duplicated


def test_run_batch_results_leave_failed_instances_for_a_rerun(tmp_path):
    path = tmp_path / "runs.jsonl"
    batch = [{"topic": t} for t in ("sea", "boom", "rain")]
    results = haiku.run_batch(
        batch, backend=MockBackend(fail_on="boom"), progress=False, results=path
    )
    assert type(results[1]).__name__ == "InstanceError"
    backend = MockBackend()
    haiku.run_batch(batch, backend=backend, progress=False, results=path)
    assert len(backend.requests) == 1  # only the failed one ran again


# ------------------------------------------------------------------ flowlang batch


@program
def greet(s, name: str, tokens: int = 4):
    s += f"Write a greeting for {name}. Greeting:"
    s += gen("greeting", max_new_tokens=tokens, temperature=0)


def files(source, out, *more):
    """`flowlang batch`'s arguments for input `source`, output `out`, and `more`."""
    return ["-i", str(source), "-o", str(out), *more]


def run_cli(args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "flowlang", "batch", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


def engine_args(model_dir):
    return ["--model", str(model_dir), "--max-kv-tokens", "20000", "--no-progress"]


def records(path):
    return (
        [json.loads(x) for x in Path(path).read_text().splitlines()] if Path(path).exists() else []
    )


def test_offline_batch_runs_chat_completion_and_program_lines(tmp_path, tiny_model_dir):
    system = "You are a helpful assistant who answers briefly. " * 8
    chat = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Say hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    lines = [
        line("chat-1", chat, url="/v1/chat/completions"),
        line("chat-2", chat | {"max_tokens": 5}, url="/v1/chat/completions"),
        line("cmpl", {"prompt": system + "Hello", "max_tokens": 4, "temperature": 0}),
        line("prog", {"name": "Ada"}, url="/v1/flowlang/programs/greet"),
        line("prog-bad", {"name": 5}, url="/v1/flowlang/programs/greet"),
        line("cmpl-bad", {"prompt": "x", "max_tokens": 0}),
        "not json",
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    program = ["--program", "tests.test_batch_files:greet", *engine_args(tiny_model_dir)]
    done = run_cli(files(source, out, *program))
    assert done.returncode == 0, done.stderr
    good, bad = records(out), records(tmp_path / "out.errors.jsonl")
    assert sorted(r["custom_id"] for r in good) == ["chat-1", "chat-2", "cmpl", "prog"]
    assert sorted(str(r["custom_id"]) for r in bad) == ["None", "cmpl-bad", "prog-bad"]
    by_id = {r["custom_id"]: r["response"]["body"] for r in good}
    assert by_id["chat-1"]["object"] == "chat.completion"
    assert by_id["chat-2"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert isinstance(by_id["prog"]["variables"]["greeting"], str)
    prog_bad = next(r for r in bad if r["custom_id"] == "prog-bad")
    assert prog_bad["response"]["status_code"] == 400
    assert "name" in prog_bad["error"]["message"]
    again = run_cli(files(source, out, *program))
    assert "0 completed, 0 failed, 7 already done" in again.stderr
    assert len(records(out)) == 4 and len(records(tmp_path / "out.errors.jsonl")) == 3


def test_a_batch_killed_part_way_resumes_with_nothing_lost_repeated_or_recomputed(
    tmp_path, tiny_model_dir
):
    # distinct prompts (no shared prefix): the prefill a run computes is exactly its lines'
    lines = [
        line(f"r{i}", {"prompt": f"{i} " + "word " * (20 + i), "max_tokens": 24, "temperature": 0})
        for i in range(24)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    two_at_a_time = ["--max-in-flight", "2", *engine_args(tiny_model_dir)]
    assert run_cli(files(source, whole, *two_at_a_time)).returncode == 0
    args = [sys.executable, "-m", "flowlang", "batch", *files(source, out, *two_at_a_time)]
    victim = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while len(records(out)) < 8 and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    before = {r["custom_id"] for r in records(out)}
    assert 8 <= len(before) < 24
    resumed = run_cli(files(source, out, *two_at_a_time))
    assert resumed.returncode == 0, resumed.stderr
    final = records(out)
    assert sorted(r["custom_id"] for r in final) == sorted(f"r{i}" for i in range(24))  # once
    text = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in final}
    assert text == {
        r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records(whole)
    }
    # the resumed run's prefill (computed, or read from the cache: lines share a BOS and a
    # digit or two) is exactly the prompts of the lines it ran: none of the finished lines'
    new_prompts = sum(
        r["response"]["body"]["usage"]["prompt_tokens"]
        for r in final
        if r["custom_id"] not in before
    )
    assert f"{24 - len(before)} completed, 0 failed, {len(before)} already done" in resumed.stderr
    found = re.search(r"prefill (\d+) tokens computed, (\d+) read from the cache", resumed.stderr)
    computed, cached = int(found[1]), int(found[2])
    assert computed + cached == new_prompts and cached < 24


# ------------------------------------------------------------------ programs over HTTP


def test_registered_programs_answer_over_http(tiny_model_dir, monkeypatch):
    from conftest import ServerThread

    from flowlang.program import Program
    from flowlang.program_routes import program_extension
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    priorities = []  # each run's, as the route starts it
    run = Program.run

    def recorded(self, *args, priority=0, **kwargs):
        priorities.append(priority)
        return run(self, *args, priority=priority, **kwargs)

    monkeypatch.setattr(Program, "run", recorded)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=20_000))
    server = ServerThread(engine, extensions=[program_extension([greet])])
    try:
        url = server.url + "/v1/flowlang/programs"
        listed = httpx.get(url).json()
        assert [p["name"] for p in listed["data"]] == ["greet"]
        ok = httpx.post(url + "/greet", json={"name": "Ada", "tokens": 3}, timeout=60)
        assert ok.status_code == 200
        direct = greet.run(name="Ada", tokens=3, backend=_local(engine))
        assert ok.json()["variables"] == {"greeting": direct["greeting"]}
        bad = httpx.post(url + "/greet", json={"nam": "Ada"}, timeout=60)
        assert bad.status_code == 400 and "'nam'" in bad.json()["error"]["message"]
        missing = httpx.post(url + "/nope", json={}, timeout=60)
        assert missing.status_code == 404 and "greet" in missing.json()["error"]["message"]
        # a run's priority from Dynamo's header; a session header is refused, not dropped
        urgent = {"X-Dynamo-Request-Priority": "3"}
        assert httpx.post(url + "/greet", json={"name": "Bo"}, headers=urgent).status_code == 200
        assert priorities == [0, 0, 3]  # (the two above, then this one)
        for header, value in (("X-Dynamo-Request-Priority", "high"), ("X-Session-ID", "s1")):
            refused = httpx.post(url + "/greet", json={"name": "Bo"}, headers={header: value})
            assert refused.status_code == 400
            assert header.lower() in refused.json()["error"]["message"]
        assert len(priorities) == 3
    finally:
        server.stop()
        engine.close()


def _local(engine):
    from flowlang.backends.local import LocalBackend

    return LocalBackend(engine)


def test_a_restarted_batch_reads_its_shared_prefix_back_from_the_disk_tier(
    tmp_path, tiny_model_dir
):
    shared = "The shared instructions of every line in this batch. " * 12
    lines = [
        line(f"r{i}", {"prompt": shared + f"Item {i}:", "max_tokens": 3, "temperature": 0})
        for i in range(8)
    ]
    first, whole = tmp_path / "first.jsonl", tmp_path / "in.jsonl"
    first.write_text("\n".join(lines[:4]) + "\n")
    whole.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    disk = ["--disk-kv-dir", str(tmp_path / "kv"), "--kv-write-policy", "write_through"]
    ran = run_cli(files(first, out, *disk, *engine_args(tiny_model_dir)))
    assert "(0 loaded from disk)" in ran.stderr, ran.stderr
    resumed = run_cli(files(whole, out, *disk, *engine_args(tiny_model_dir)))
    assert "4 completed, 0 failed, 4 already done" in resumed.stderr, resumed.stderr
    loaded = int(re.search(r"\((\d+) loaded from disk\)", resumed.stderr)[1])
    assert loaded >= 100  # the shared prefix (~130 tokens), not computed again


def test_run_batch_priority_goes_with_each_instances_requests():
    """`priority` is each instance's, from its arguments: every request of the instance
    carries it (the engine's program gate enters programs by it); without it, 0."""
    batch = [{"topic": t, "lines": n} for t, n in (("sea", 3), ("hill", 1), ("rain", 2))]
    backend = MockBackend()
    haiku.run_batch(batch, backend=backend, progress=False, priority=lambda a: -a["lines"])
    by_program: dict[str, set[int]] = {}
    for request in backend.requests:
        by_program.setdefault(request.hints.program_id, set()).add(request.hints.priority)
    assert sorted(map(len, by_program.values())) == [1, 1, 1]  # one priority per program
    sizes = sorted((len([r for r in backend.requests if r.hints.program_id == p]), *v)
                   for p, v in by_program.items())  # fmt: skip
    assert sizes == [(1, -1), (2, -2), (3, -3)]  # each its own instance's
    plain = MockBackend()
    haiku.run_batch(batch, backend=plain, progress=False)
    assert {r.hints.priority for r in plain.requests} == {0}
