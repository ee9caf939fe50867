"""`flowlang serve --replicas 2` when Ray's control store (the GCS) is killed: /health turns 503
within seconds (not after Ray's own minute), new requests get a 503 with Retry-After, the
requests in flight are answered (whole, or a JSON 503 / a stream's error frame: never a cut
connection), and the server exits with status 70 for its supervisor, before Ray would end it.
A subprocess with its own Ray, as a user runs it; only its own GCS is killed."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import psutil
from test_shutdown import DEADLINE_S, ENV, Serve, ServeExited, _wait_for

MAX_KV_TOKENS = 8192  # per replica, the tiny model's context (its KV: a few MiB)
RAY_START_ATTEMPTS = 3
RAY_NODE_TIMEOUT = "The current node timed out during startup"


def _serve_replicas(model_dir) -> Serve:
    """Two replicas on a Ray of their own (never a shared one: RAY_ADDRESS is dropped). Ray
    gives its node a fixed 30 s to start, which a busy machine can exceed: that, and only
    that, is tried again."""
    env = {k: v for k, v in ENV.items() if k != "RAY_ADDRESS"}
    options = ("--replicas", "2", "--routing-policy", "round_robin", "--drain-timeout", "600")
    options += ("--max-kv-tokens", str(MAX_KV_TOKENS))  # one long request per replica
    for _ in range(RAY_START_ATTEMPTS - 1):
        try:
            return Serve(model_dir, *options, env=env)
        except ServeExited as err:
            if RAY_NODE_TIMEOUT not in str(err):
                raise
    return Serve(model_dir, *options, env=env)


def test_a_lost_gcs_turns_health_503_answers_what_runs_and_exits_70(tiny_model_dir):
    server = _serve_replicas(tiny_model_dir)
    answers: dict[str, object] = {}
    first_frame = threading.Event()
    # long enough to still run when the loss is seen (seconds), however fast the machine; on
    # a slow one they are answered with a 503 at the end of the drain
    sampling = {"max_new_tokens": MAX_KV_TOKENS - 60, "ignore_eos": True}

    def whole() -> None:
        body = {"input_ids": list(range(100, 140)), "sampling_params": sampling}
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=DEADLINE_S)
        answers["whole"] = (reply.status_code, reply.headers, reply.text)

    def streamed() -> None:
        body = {"input_ids": list(range(300, 340)), "sampling_params": sampling, "stream": True}
        frames: list[str] = []
        try:
            with httpx.stream(
                "POST", f"{server.url}/generate", json=body, timeout=DEADLINE_S
            ) as reply:
                for line in reply.iter_lines():
                    if line:
                        frames.append(line)
                        first_frame.set()
            answers["stream"] = (reply.status_code, frames)
        except httpx.HTTPError as err:  # a cut stream: what must never happen
            answers["stream"] = (err, frames)

    # round-robin: one on each replica
    clients = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    try:
        for client in clients:
            client.start()
        assert first_frame.wait(DEADLINE_S), "the stream sent nothing"
        _wait_for(lambda: server.running() == 2, "the two requests never ran together")
        (gcs,) = [
            p
            for p in psutil.Process(server.process.pid).children(recursive=True)
            if p.name() == "gcs_server"
        ]
        gcs.send_signal(signal.SIGKILL)
        health: list[httpx.Response] = []

        def unhealthy() -> bool:
            health.append(httpx.get(f"{server.url}/health", timeout=DEADLINE_S))
            return health[-1].status_code == 503

        _wait_for(unhealthy, "/health never turned 503")
        assert "GCS" in health[-1].json()["error"], health[-1].text
        _wait_for(
            lambda: httpx.get(f"{server.url}/v1/models", timeout=DEADLINE_S).status_code == 503,
            "new requests were still taken",
        )
        refused = httpx.get(f"{server.url}/v1/models", timeout=DEADLINE_S)
        assert int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["code"] == 503
        for client in clients:
            client.join(DEADLINE_S)
        status = server.process.wait(DEADLINE_S)
    finally:
        server.stop()
    # 70 is the server's own exit after its drain: had it waited for Ray's own limit on a
    # lost GCS (a minute), Ray would have ended the process otherwise
    assert status == 70, "".join(server.lines[-30:])
    code, headers, text = answers["whole"]
    if code != 200:  # not finished within the drain: a clean 503, never a cut connection
        assert code == 503 and json.loads(text)["error"]["code"] == 503, text
        assert int(headers["retry-after"]) > 0
    code, frames = answers["stream"]
    assert code == 200 and frames[-1] == "data: [DONE]", (code, frames[-3:])
    last = json.loads(frames[-2].removeprefix("data: "))
    if "error" in last:
        assert last["error"]["code"] == 503, last
    else:
        assert last["meta_info"]["finish_reason"]["type"] == "length", last
