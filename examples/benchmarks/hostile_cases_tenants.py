"""hostile_bench.py's cases against a server with two tenants and an admin: fields that must be
honoured or refused (never a 200 that did nothing), what one tenant may see or do to another,
shared workers one tenant may try to monopolise, and the server's own end (SIGTERM) and a
replica's (kill -9, behind --replicas 2).

Outcomes here are words for what happened ("honoured", "ignored", "isolated", "leak",
"unaffected", "starved", "drained", "lost", "rerun") or the status a refusal got ("400").
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
from hostile_cases import CHAT, HANG_S, Case, Outcome

KEYS = {"a": "tenant-a-key", "b": "tenant-b-key", "admin": "admin-key"}
VICTIM_SLOW_S = 5.0  # another tenant's 1-token request slower than this: starved
PROBES_AT_S = (1.0, 5.0, 12.0, 25.0, 45.0)  # when the other tenant asks, after the load began
VICTIM_REQUESTS = (
    ("/v1/flowlang/tokenize", {"text": "a victim"}),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}),
)
LONG_IDS = list(range(1000, 1400))  # a 400-token prompt


def auth(tenant: str = "a") -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[tenant]}"}


def _post(
    url: str, path: str, body: dict, tenant: str = "a", timeout: float = 60
) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=auth(tenant), timeout=timeout)


def _frames(url: str, path: str, body: dict, tenant: str = "a") -> tuple[int, list[dict]]:
    """A stream's status and its data frames (JSON), [DONE] left out."""
    with httpx.stream(
        "POST", url + path, json={**body, "stream": True}, headers=auth(tenant), timeout=HANG_S
    ) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, []
        lines = [x[6:] for x in response.iter_lines() if x.startswith("data: ")]
    return 200, [json.loads(x) for x in lines if x != "[DONE]"]


# ---------------------------------------------------------------- silent acceptance


def _judged(check: Callable[[str], bool | int]) -> Callable[[str], Outcome]:
    """A case whose `check` says True (honoured), False (a 200 that did nothing) or a status."""

    def run(url: str) -> Outcome:
        verdict = check(url)
        if verdict is True:
            return "honoured"
        return "ignored" if verdict is False else str(verdict)

    return run


def _completion(url: str, **fields) -> httpx.Response:
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, **fields}
    return _post(url, "/v1/completions", body)


def _chat(url: str, content: str = "Say hello.", **fields) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}
    return _post(url, CHAT, {"max_tokens": 12, **body})


def _status_or(response: httpx.Response, judge: Callable[[dict], bool]) -> bool | int:
    return judge(response.json()) if response.status_code == 200 else response.status_code


def logit_bias(url: str) -> bool | int:
    plain = _completion(url)
    biased = _completion(url, logit_bias={"504": 100})
    if biased.status_code != 200:
        return biased.status_code
    return biased.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]


def echo(url: str) -> bool | int:
    return _status_or(
        _completion(url, echo=True),
        lambda b: b["choices"][0]["text"].startswith("The capital of France is"),
    )


def refused_only(field: str, value) -> Callable[[str], bool | int]:
    """A field whose effect the bench cannot see: any 200 counts as ignored."""
    return lambda url: _status_or(_completion(url, **{field: value}), lambda b: False)


def streamed_usage(url: str) -> bool | int:
    body = {"prompt": "Hi", "max_tokens": 4, "stream_options": {"include_usage": True}}
    status, frames = _frames(url, "/v1/completions", body)
    return any(f.get("usage") for f in frames) if status == 200 else status


def streamed_logprobs(path: str, body: dict) -> Callable[[str], bool | int]:
    def check(url: str) -> bool | int:
        status, frames = _frames(url, path, body)
        if status != 200:
            return status
        return any((c.get("logprobs") or None) for f in frames for c in f.get("choices", []))

    return check


def guided(field: str, value, valid: Callable[[str], bool]) -> Callable[[str], bool | int]:
    def check(url: str) -> bool | int:
        response = _chat(url, "Answer with a number or a word.", **{field: value}, max_tokens=64)
        return _status_or(response, lambda b: valid(b["choices"][0]["message"]["content"]))

    return check


def guided_json(url: str) -> bool | int:
    """Honoured if the answer is the one response_format's json_schema (the constraint OpenAI
    defines) gives: a small model may fill an integer with digits until max_tokens, so the
    answer itself need not parse."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    question = "Answer with a number or a word."
    guided = _chat(url, question, guided_json=schema, max_tokens=64)
    if guided.status_code != 200:
        return guided.status_code
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    reference = _chat(url, question, response_format=fmt, max_tokens=64).json()
    answer = guided.json()["choices"][0]["message"]["content"]
    return answer.startswith("{") and answer == reference["choices"][0]["message"]["content"]


def n_usage(url: str) -> bool | int:
    one, three = _completion(url), _completion(url, n=3)
    if three.status_code != 200:
        return three.status_code
    return three.json()["usage"]["prompt_tokens"] == one.json()["usage"]["prompt_tokens"]


def chat_without_max_tokens(url: str) -> bool | int:
    """300 tokens at least (min_tokens), no max_tokens: the rest of the context may be used."""
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "min_tokens": 300}
    response = _post(url, CHAT, body, timeout=300)
    return _status_or(response, lambda b: b["usage"]["completion_tokens"] >= 300)


def unknown_model(url: str) -> bool | int:
    return _completion(url, model="no-such-model").status_code == 404 or False


def sglang_logprob_deltas(url: str) -> bool | int:
    """Streamed /generate: each chunk's output_token_logprobs are the tokens new since the last
    chunk (as SGLang sends them), so they add up to the tokens generated."""
    body = {
        "text": "Count: 1, 2, 3,",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    status, frames = _frames(url, "/generate", body)
    if status != 200:
        return status
    return sum(len(f["meta_info"]["output_token_logprobs"]) for f in frames) == 8


def silent() -> list[Case]:
    cases = {
        "logit_bias": (logit_bias, ("honoured", "4")),
        "echo": (echo, ("honoured", "4")),
        "suffix": (refused_only("suffix", " the end."), ("4",)),
        "best_of 2": (refused_only("best_of", 2), ("honoured", "4")),
        "completions include_usage stream": (streamed_usage, ("honoured", "4")),
        "completions logprobs stream": (
            streamed_logprobs("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logprobs": 1}),
            ("honoured", "4"),
        ),
        "chat logprobs stream": (
            streamed_logprobs(
                CHAT,
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "logprobs": True,
                },
            ),
            ("honoured", "4"),
        ),
        "guided_choice": (
            guided("guided_choice", ["yes", "no"], {"yes", "no"}.__contains__),
            ("honoured", "4"),
        ),
        "guided_regex": (
            guided("guided_regex", "[0-9]{3}", lambda t: re.fullmatch("[0-9]{3}", t) is not None),
            ("honoured", "4"),
        ),
        "guided_json": (guided_json, ("honoured", "4")),
        "structured_outputs choice": (
            guided("structured_outputs", {"choice": ["yes", "no"]}, {"yes", "no"}.__contains__),
            ("honoured", "4"),
        ),
        "n 3 usage": (n_usage, ("honoured",)),
        "chat without max_tokens": (chat_without_max_tokens, ("honoured",)),
        "unknown model": (unknown_model, ("honoured",)),
        "SGLang stream logprob deltas": (sglang_logprob_deltas, ("honoured",)),
    }
    return [Case("silent", name, _judged(check), expect) for name, (check, expect) in cases.items()]


# ---------------------------------------------------------------- tenants


def _long(url: str, tenant: str, out: dict, key: str, **fields) -> threading.Thread:
    """A 150-token /generate of `tenant` in a thread; its response lands in out[key]."""
    body = {
        "input_ids": LONG_IDS,
        "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True},
        **fields,
    }

    def run() -> None:
        try:
            out[key] = _post(url, "/generate", body, tenant, timeout=120)
        except httpx.HTTPError as err:
            out[key] = err

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _complete(response) -> bool:
    return (
        isinstance(response, httpx.Response)
        and response.status_code == 200
        and len(response.json()["output_ids"]) == 150
    )


def reused_rid(url: str) -> Outcome:
    out: dict = {}
    thread = _long(url, "a", out, "a", rid="shared-rid")
    time.sleep(1.0)
    b = _post(
        url,
        "/generate",
        {"text": "Hi", "rid": "shared-rid", "sampling_params": {"max_new_tokens": 2}},
        "b",
    )
    thread.join()
    if b.status_code != 200:
        return "leak" if "shared-rid" in b.text else str(b.status_code)
    return "isolated" if _complete(out["a"]) else "collateral"


def dashboard_data(url: str) -> Outcome:
    ns = "a-private-namespace"
    pin = _post(url, "/v1/flowlang/pin", {"prefix_ids": list(range(1, 65)), "namespace": ns}, "a")
    _post(
        url,
        "/generate",
        {"text": "secret words", "namespace": ns, "sampling_params": {"max_new_tokens": 2}},
        "a",
    )
    try:
        seen = httpx.get(url + "/dashboard/data", headers=auth("b"), timeout=HANG_S).text
    finally:
        if pin.status_code == 200:
            httpx.delete(f"{url}/v1/flowlang/pin/{pin.json()['pin_id']}", headers=auth("a"))
    leaked = ns in seen or (pin.status_code == 200 and pin.json()["pin_id"] in seen)
    return "leak" if leaked else "isolated"


def concurrent_pins(url: str) -> Outcome:
    """4 pins of 1,500 tokens at once against a 2,048-token quota (half the 4,096 pool): one
    fits; then tenant B pins 500."""
    results: list[httpx.Response] = []

    def pin(i: int) -> None:
        ids = [2000 + 1500 * i + j for j in range(1500)]
        results.append(_post(url, "/v1/flowlang/pin", {"prefix_ids": ids}, "a"))

    threads = [threading.Thread(target=pin, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    b = _post(url, "/v1/flowlang/pin", {"prefix_ids": list(range(100, 600))}, "b")
    for response in [*results, b]:
        if response.status_code == 200:
            owner = "b" if response is b else "a"
            httpx.delete(f"{url}/v1/flowlang/pin/{response.json()['pin_id']}", headers=auth(owner))
    held = sum(r.status_code == 200 for r in results)
    if held > 1:
        return "leak"  # the quota did not hold
    return "isolated" if b.status_code == 200 else "collateral"


def tenants() -> list[Case]:
    return [
        Case("tenants", "B reuses A's request id", reused_rid, ("isolated",)),
        Case("tenants", "B reads the dashboard", dashboard_data, ("isolated",)),
        Case("tenants", "4 concurrent pins vs quota", concurrent_pins, ("isolated",)),
    ]


# ---------------------------------------------------------------- starvation


def while_busy(start_bad: Callable[[str], Callable[[], None]]) -> Callable[[str], Outcome]:
    """Tenant A starts its load (`start_bad` returns its cleanup); at each of PROBES_AT_S tenant B
    tokenizes and asks for one token: "starved" if any of those took over VICTIM_SLOW_S."""

    def run(url: str) -> Outcome:
        cleanup = start_bad(url)
        slowest, statuses, begun = 0.0, set(), time.monotonic()
        try:
            for at_s in PROBES_AT_S:
                time.sleep(max(0.0, begun + at_s - time.monotonic()))
                for path, body in VICTIM_REQUESTS:
                    started = time.monotonic()
                    statuses.add(_post(url, path, body, "b", timeout=120).status_code)
                    slowest = max(slowest, time.monotonic() - started)
        finally:
            cleanup()
        print(f"    the other tenant's slowest probe: {slowest:.2f} s", file=sys.stderr, flush=True)
        if statuses != {200}:
            return str(max(statuses))
        return "starved" if slowest > VICTIM_SLOW_S else "unaffected"

    return run


def _in_threads(url: str, path: str, bodies: list[dict], timeout: float, tenant: str = "a"):
    threads = []
    for body in bodies:

        def one(body=body) -> None:
            try:
                _post(url, path, body, tenant, timeout=timeout)
            except httpx.HTTPError:
                pass  # the attacker gives up: only the victim's time is measured

        threads.append(threading.Thread(target=one, daemon=True))
        threads[-1].start()
    return lambda: [t.join() for t in threads]


def backtracking_stop(url: str):
    body = {
        "text": "a",
        "sampling_params": {
            "max_new_tokens": 200,
            "regex": "a{300}",  # a long run of a's, where (a|a)+b backtracks
            "stop_regex": ["(a|a)+b"],
            "temperature": 0,
        },
    }
    return _in_threads(url, "/generate", [body], timeout=90)


def huge_score(url: str):
    conts = [[5 + i % 400, 7 + i % 300] for i in range(7000)]
    return _in_threads(
        url, "/v1/flowlang/score", [{"prefix": [1, 2, 3], "continuations": conts}], 90
    )


def slow_regexes(url: str):
    bodies = [
        {
            "text": "x",
            "sampling_params": {"max_new_tokens": 2, "regex": f"( ?[a-z]+){{1,12}}\\.{i}"},
        }
        for i in range(20)
    ]
    return _in_threads(url, "/generate", bodies, timeout=5)


def idle_followers(url: str):
    stop = threading.Event()

    def follow() -> None:
        try:
            with httpx.stream(
                "GET", url + "/v1/flowlang/kv_events", headers=auth("admin"), timeout=None
            ) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=follow, daemon=True) for _ in range(40)]
    for thread in threads:
        thread.start()
    return stop.set


def starvation() -> list[Case]:
    cases = {
        "backtracking stop_regex": backtracking_stop,
        "7,000-continuation score": huge_score,
        "40 idle kv_events followers": idle_followers,
        "20 slow regex compiles": slow_regexes,  # last: the compiles outlive their clients
    }
    return [Case("starvation", n, while_busy(f), ("unaffected", "4")) for n, f in cases.items()]


# ---------------------------------------------------------------- lifecycle


def sigterm(server) -> Outcome:
    """4 long requests (2 streamed), then SIGTERM: each ends complete or with a JSON 503 / a
    terminal error frame; a request sent during the drain gets 503 + Retry-After; exit 0."""
    url, out = server.url, {}
    threads = [_long(url, "a", out, f"plain{i}") for i in range(2)]

    def stream(key: str) -> None:
        body = {
            "input_ids": LONG_IDS,
            "sampling_params": {"max_new_tokens": 150, "ignore_eos": True},
        }
        try:
            out[key] = _frames(url, "/generate", body)
        except httpx.HTTPError as err:
            out[key] = err

    for i in range(2):
        threads.append(threading.Thread(target=stream, args=(f"stream{i}",)))
        threads[-1].start()
    time.sleep(2.0)
    os.kill(server.process.pid, signal.SIGTERM)
    time.sleep(0.3)
    try:
        late = _post(
            url, "/generate", {"text": "late", "sampling_params": {"max_new_tokens": 2}}, timeout=10
        )
        late_ok = late.status_code == 503 and "retry-after" in late.headers
    except httpx.TransportError:
        late_ok = True  # the listener is already closed: refused, nothing accepted
    for thread in threads:
        thread.join()
    try:
        exited = server.process.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        exited = False
    answered = all(_ended_cleanly(out.get(k)) for k in ("plain0", "plain1", "stream0", "stream1"))
    return "drained" if answered and late_ok and exited else "lost"


def _ended_cleanly(result) -> bool:
    if isinstance(result, httpx.Response):
        if result.status_code == 200:
            return _complete(result)
        try:
            return result.status_code == 503 and "error" in result.json()
        except ValueError:
            return False  # a plain-text 500
    if isinstance(result, tuple):
        status, frames = result
        if status != 200 or not frames:
            return False
        last = frames[-1]
        return "error" in last or last.get("meta_info", {}).get("finish_reason") is not None
    return False


def _descendant(pid: int, pattern: str) -> int | None:
    """A process under `pid` whose command line matches `pattern`."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    for candidate in map(int, found):
        parent = candidate
        while parent > 1:
            if parent == pid:
                return candidate
            with open(f"/proc/{parent}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    return None


def replica_killed(server) -> Outcome:
    """kill -9 of a replica while 4 requests run: every non-streamed request answered once."""
    url, out = server.url, {}
    threads = [_long(url, "a", out, f"r{i}") for i in range(4)]
    time.sleep(2.0)
    victim = _descendant(server.process.pid, "ray::Replica")
    if victim is None:
        return "no replica process"
    os.kill(victim, signal.SIGKILL)
    for thread in threads:
        thread.join()
    return "rerun" if all(_complete(out[f"r{i}"]) for i in range(4)) else "lost"


def gcs_killed(server) -> Outcome:
    """kill -9 of Ray's GCS: /health 503 within 5 s, in-flight requests answered (complete or
    a JSON 503), the process ends by itself."""
    url, out = server.url, {}
    threads = [_long(url, "a", out, f"r{i}") for i in range(2)]
    time.sleep(2.0)
    gcs = _descendant(server.process.pid, "gcs_server")
    if gcs is None:
        return "no gcs process"
    os.kill(gcs, signal.SIGKILL)
    deadline, unhealthy = time.monotonic() + 5, False
    while time.monotonic() < deadline and not unhealthy:
        try:
            unhealthy = httpx.get(url + "/health", timeout=1).status_code == 503
        except httpx.HTTPError:
            unhealthy = True
        time.sleep(0.2)
    for thread in threads:
        thread.join()
    answered = all(_ended_cleanly(out[f"r{i}"]) for i in range(2))
    return "graceful" if unhealthy and answered else "lost"


def lifecycle() -> list[Case]:
    return [Case("shutdown", "SIGTERM with 4 long requests", sigterm, ("drained",), process=True)]


def replicas() -> list[Case]:
    return [
        Case("replica", "kill -9 a replica mid-request", replica_killed, ("rerun",), process=True),
        Case("replica", "kill -9 Ray's GCS", gcs_killed, ("graceful",), process=True),
    ]


CASES = [*silent(), *tenants(), *starvation(), *lifecycle()]
REPLICA_CASES = replicas()
