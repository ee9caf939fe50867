"""`flowlang serve` shuts down without losing an accepted request: on SIGTERM it stops taking
new ones (503 with Retry-After, /health 503 "draining"), lets the running ones finish within
--drain-timeout, fails what is left with a JSON 503 or a stream's terminal error frame (never a
cut connection), and exits 0. Run as a user runs it: the real entry point in a subprocess.
Conditions are waited for (the engine's running count, /health), never slept on."""

from __future__ import annotations

import json
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
from hypothesis import given
from hypothesis import strategies as st

from runtime.server.drain import FAIL_GRACE_S, Drain

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
DEADLINE_S = 300  # generous: the machine may be shared


class ServeExited(RuntimeError):
    """`flowlang serve` exited before it served (its last lines say why)."""


class Serve:
    """`flowlang serve` in a subprocess, its stderr collected; it must start serving (a
    process that exits first fails at once, with what it printed)."""

    def __init__(
        self, model_dir: pathlib.Path, *options: str, env: dict[str, str] | None = None
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flowlang", "serve", "--model", str(model_dir)]
            + ["--port", "0", "--max-kv-tokens", "4096", *options],
            cwd=ROOT,
            env=env or ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        found: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            for line in self.process.stderr:
                self.lines.append(line)
                if match := re.search(r"serving on (http://\S+);", line):
                    found.put(match.group(1))
            found.put(None)  # it exited

        threading.Thread(target=read, daemon=True).start()
        url = found.get(timeout=DEADLINE_S)
        if url is None:
            self.process.wait(60)
            raise ServeExited("".join(self.lines[-30:]))
        self.url = url

    def running(self) -> float:
        """The engine's running requests, from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=60).text
        return float(re.search(r"^flowlang_num_running (\S+)$", text, re.M).group(1))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(60)


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _long_requests(
    server: Serve, model: str, max_tokens: int
) -> tuple[dict, list[threading.Thread]]:
    """Two whole and two streamed requests of `max_tokens` each, running when this returns."""
    answers: dict[str, object] = {}
    streaming = threading.Barrier(3)

    def whole(name: str) -> None:
        body = {"text": "Once", "sampling_params": {"max_new_tokens": max_tokens}}
        body["sampling_params"]["ignore_eos"] = True
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=DEADLINE_S)
        answers[name] = (reply.status_code, reply.headers, reply.text)

    def streamed(name: str) -> None:
        body = {"model": model, "prompt": "Once", "max_tokens": max_tokens, "stream": True}
        body["ignore_eos"] = True
        frames = []
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, timeout=DEADLINE_S
            ) as reply:
                for line in reply.iter_lines():
                    if line:
                        frames.append(line)
                        if len(frames) == 1:
                            streaming.wait()
                answers[name] = (reply.status_code, frames)
        except httpx.HTTPError as err:  # a cut stream: what must never happen
            answers[name] = (err, frames)

    threads = [threading.Thread(target=whole, args=(f"whole{i}",)) for i in range(2)]
    threads += [threading.Thread(target=streamed, args=(f"stream{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    streaming.wait(timeout=DEADLINE_S)  # both streams sent their first frame
    _wait_for(lambda: server.running() == 4, "the four requests never ran together")
    return answers, threads


def _sigterm_and_probe(server: Serve) -> None:
    """SIGTERM; once /health says it drains, a new request must get a 503 with Retry-After."""
    server.process.send_signal(signal.SIGTERM)

    def draining() -> bool:
        health = httpx.get(f"{server.url}/health", timeout=60)
        return health.status_code == 503 and health.json()["status"] == "draining"

    _wait_for(draining, "/health never said it drains")
    assert httpx.get(f"{server.url}/metrics", timeout=60).status_code == 200  # probes answer
    fresh = httpx.post(f"{server.url}/generate", json={"text": "Hi"}, timeout=60)
    assert fresh.status_code == 503, fresh.text
    assert int(fresh.headers["retry-after"]) > 0
    assert fresh.json()["error"]["code"] == 503
    assert "shutting down" in fresh.json()["error"]["message"]


def test_sigterm_lets_running_requests_finish_then_exits_0(tiny_model_dir):
    server = Serve(tiny_model_dir, "--drain-timeout", "600")
    try:
        answers, threads = _long_requests(server, str(tiny_model_dir), max_tokens=600)
        _sigterm_and_probe(server)
        for thread in threads:
            thread.join(DEADLINE_S)
        assert server.process.wait(DEADLINE_S) == 0, "".join(server.lines[-20:])
    finally:
        server.stop()
    for i in range(2):
        status, _, text = answers[f"whole{i}"]
        assert status == 200, text
        meta = json.loads(text)["meta_info"]
        assert meta["completion_tokens"] == 600 and meta["finish_reason"]["type"] == "length"
        status, frames = answers[f"stream{i}"]
        assert status == 200, (status, frames[-3:])
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length", frames[-3:]
    assert any("stopped (SIGTERM)" in line for line in server.lines)


def test_sigterm_past_the_grace_fails_what_runs_with_503s_and_error_frames(tiny_model_dir):
    """A zero grace: the four running requests cannot finish (900 tokens each), each gets
    a JSON 503 with Retry-After or, streamed, an error frame and [DONE]; the process exits 0."""
    server = Serve(tiny_model_dir, "--drain-timeout", "0")
    try:
        answers, threads = _long_requests(server, str(tiny_model_dir), max_tokens=900)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(DEADLINE_S)
        assert server.process.wait(DEADLINE_S) == 0, "".join(server.lines[-20:])
    finally:
        server.stop()
    for i in range(2):
        status, headers, text = answers[f"whole{i}"]
        assert status == 503, text
        assert headers["content-type"] == "application/json"
        assert int(headers["retry-after"]) > 0
        assert json.loads(text)["error"]["code"] == 503
        status, frames = answers[f"stream{i}"]
        assert status == 200, (status, frames[-3:])
        assert frames[-1] == "data: [DONE]", frames[-3:]
        error = json.loads(frames[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down" in error["message"]


@given(
    grace_s=st.floats(0, 100),
    steps=st.lists(st.tuples(st.floats(0, 50), st.integers(0, 3)), max_size=12),
)
def test_a_drain_stops_only_when_nothing_runs_or_the_failed_had_their_time(grace_s, steps):
    """Whatever the times and the requests in flight: the drain expires only once the grace
    is over, and lets the server stop only with nothing running, or FAIL_GRACE_S after that."""
    drain = Drain(grace_s)
    assert not drain.tick(0.0)  # not draining: never stops
    began = 1.0
    drain.begin("SIGTERM", began)
    drain.begin("later", began + 1)  # the first reason wins
    now = began
    for dt, in_flight in steps:
        now += dt
        drain.in_flight = in_flight
        stops = drain.tick(now)
        assert drain.expired <= (now >= began + grace_s)
        assert stops == (in_flight == 0 or now >= began + grace_s + FAIL_GRACE_S)
    assert drain.reason == "SIGTERM" and drain.draining
