"""A soak: 64 clients for 60 s against one server on the tiny model, mixing valid requests
(SGLang /generate and OpenAI /v1/completions, some streamed), invalid bodies, streams the
client hangs up on after the first chunk, and non-streaming clients that give up on a long
generation. Nothing lost (every valid request answered, a 4xx for every invalid one, no 5xx),
nothing leaked (no request running or waiting, no KV slot held, slots conserved, the server's
in-flight counts back to zero) and memory flat (resident memory from 10 s in to the end,
measured after a garbage collection and malloc_trim, so the C allocator's retained free
memory does not hide or fake a leak).

FLOWLANG_SOAK_SECONDS shortens (or lengthens) the run for a quick local check."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest
from conftest import ServerThread

from runtime.config import EngineConfig
from runtime.engine import Engine

NUM_CLIENTS = 64
SOAK_S = float(os.environ.get("FLOWLANG_SOAK_SECONDS", "60"))
VALID_TIMEOUT_S = 120.0  # a valid request under full load still answers within this
GIVE_UP_S = 0.5  # a disconnecting client's patience
RSS_GROWTH_BOUND = 200 << 20  # bytes, from 10 s in to the end
HEALTH_BOUND_S = 5.0
LONG = {"max_new_tokens": 2000, "ignore_eos": True}  # never finishes within a client's patience

INVALID = [  # (path, body): each a client mistake, each a 4xx
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}),
    ("/generate", {"input_ids": [49152], "sampling_params": {"max_new_tokens": 1}}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "regex": "("}}),
    ("/generate", {"text": "hi", "no_such_field": 1}),
    ("/generate", b'{"text": "hi", "sampling_params": '),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_p": 0}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/flowlang/score", {"prefix": "hi", "continuations": []}),
]


@dataclass
class Tally:
    """What the clients saw."""

    sent: Counter[str] = field(default_factory=Counter)  # by kind
    answered: Counter[str] = field(default_factory=Counter)  # valid: 200 with a full answer
    rejected: Counter[str] = field(default_factory=Counter)  # invalid: a 4xx
    gave_up: Counter[str] = field(default_factory=Counter)  # aborts and disconnects
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # valid requests


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it), once garbage is collected and
    the C allocator has handed back what it holds unused: what stays is what is alive."""
    gc.collect()
    if TRIM is not None:
        TRIM(0)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: RSS as it is
        return None


TRIM = _malloc_trim()


class HealthProbe(threading.Thread):
    """Asks /health twice a second from its own thread; keeps the slowest answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stopping = threading.Event()
        self.max_latency = 0.0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stopping.wait(0.5):
                started = time.monotonic()
                try:
                    status = client.get(self.url + "/health").status_code
                    if status != 200:
                        self.failures.append(str(status))
                except httpx.HTTPError as err:
                    self.failures.append(repr(err))
                self.max_latency = max(self.max_latency, time.monotonic() - started)


@pytest.fixture(scope="module")
def soaked(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=16_000))
    server = ServerThread(engine)
    yield server
    server.stop()


async def one_request(client: httpx.AsyncClient, rng: random.Random, i: int, tally: Tally) -> None:
    """One request of a kind drawn at random, judged by what that kind must get."""
    kind = rng.choices(
        ["generate", "generate-stream", "completion", "completion-stream", "invalid", "abort",
         "disconnect"],
        weights=[20, 12, 14, 8, 16, 15, 15],
    )[0]  # fmt: skip
    tally.sent[kind] += 1
    prompt = f"Customer {i % 8} asks about order {rng.randrange(1000)}"
    few = {"max_new_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.7])}
    started = time.monotonic()
    try:
        if kind == "generate":
            response = await client.post("/generate", json={"text": prompt, "sampling_params": few})
            ok = response.status_code == 200 and response.json()["meta_info"]["finish_reason"][
                "type"
            ] in ("length", "stop")
            answered(tally, kind, ok, response, started)
        elif kind == "completion":
            body = {"prompt": prompt, "max_tokens": few["max_new_tokens"], "temperature": 0.5}
            response = await client.post("/v1/completions", json=body)
            ok = response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in (
                "length",
                "stop",
            )
            answered(tally, kind, ok, response, started)
        elif kind in ("generate-stream", "completion-stream"):
            if kind == "generate-stream":
                path, body = "/generate", {"text": prompt, "sampling_params": few, "stream": True}
            else:
                path = "/v1/completions"
                body = {"prompt": prompt, "max_tokens": few["max_new_tokens"], "stream": True}
            async with client.stream("POST", path, json=body) as response:
                lines = [line async for line in response.aiter_lines() if line]
            frames = [line.removeprefix("data: ") for line in lines]
            ok = (
                response.status_code == 200
                and frames[-1:] == ["[DONE]"]
                and len(frames) >= 2
                and not any('"error"' in frame for frame in frames)
            )
            answered(tally, kind, ok, response, started, "\n".join(lines[-3:]))
        elif kind == "invalid":
            path, body = rng.choice(INVALID)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {"content-type": "application/json"}
            response = await client.post(path, content=content, headers=headers)
            if 400 <= response.status_code < 500:
                tally.rejected[kind] += 1
            else:
                tally.failures.append(f"invalid {path} {body!r}: {response.status_code}")
        elif kind == "abort":
            body = {"text": prompt, "sampling_params": LONG, "stream": True}
            async with client.stream("POST", "/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # one chunk, then hang up
            if response.status_code == 200:
                tally.gave_up[kind] += 1
            else:
                tally.failures.append(f"abort: {response.status_code}")
        else:  # disconnect: a non-streaming client that stops waiting
            body = {"text": prompt, "sampling_params": LONG}
            try:
                response = await client.post("/generate", json=body, timeout=GIVE_UP_S)
                tally.failures.append(f"disconnect: answered {response.status_code} in time")
            except httpx.TimeoutException:
                tally.gave_up[kind] += 1
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as err:
        tally.failures.append(f"{kind}: {err!r}")


def answered(
    tally: Tally,
    kind: str,
    ok: bool,
    response: httpx.Response,
    started: float,
    shown: str | None = None,
) -> None:
    if ok:
        tally.answered[kind] += 1
        tally.latencies.append(time.monotonic() - started)
    else:
        text = shown if shown is not None else response.text
        tally.failures.append(f"{kind}: {response.status_code} {text[:300]}")


async def soak(url: str, tally: Tally, rss: dict[str, int]) -> None:
    deadline = time.monotonic() + SOAK_S

    async def client_loop(i: int) -> None:
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=url, timeout=VALID_TIMEOUT_S) as client:
            while time.monotonic() < deadline:
                await one_request(client, rng, i, tally)

    async def sample_memory() -> None:
        await asyncio.sleep(min(10.0, SOAK_S / 6))
        rss["early"] = rss_bytes()
        while time.monotonic() < deadline:
            await asyncio.sleep(5)
            rss[f"{SOAK_S - (deadline - time.monotonic()):.0f}s"] = rss_bytes()

    await asyncio.wait_for(
        asyncio.gather(sample_memory(), *(client_loop(i) for i in range(NUM_CLIENTS))),
        SOAK_S + VALID_TIMEOUT_S + 60,
    )
    rss["end"] = rss_bytes()


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.slow
def test_soak_64_clients_mixing_valid_invalid_aborted_and_disconnecting(soaked):
    engine = soaked.engine
    before = engine.stats()
    probe = HealthProbe(soaked.url)
    probe.start()
    tally, rss = Tally(), {}
    try:
        asyncio.run(soak(soaked.url, tally, rss))
    finally:
        probe.stopping.set()
        probe.join(30)
    latencies = sorted(tally.latencies)
    aborted = engine.stats()["requests_aborted_total"] - before["requests_aborted_total"]
    rss_mib = {when: size >> 20 for when, size in rss.items()}
    print(
        f"\nsent {dict(tally.sent)}\nanswered {dict(tally.answered)}, rejected "
        f"{dict(tally.rejected)}, gave up {dict(tally.gave_up)}, engine aborts {aborted}\n"
        f"valid latency p50 {latencies[len(latencies) // 2]:.2f} s, max {latencies[-1]:.2f} s; "
        f"/health max {probe.max_latency:.2f} s; RSS MiB {rss_mib}"
    )
    # nothing lost: every request got what its kind must get
    assert not tally.failures, tally.failures[:10]
    valid = ("generate", "generate-stream", "completion", "completion-stream")
    assert all(tally.answered[k] == tally.sent[k] > 0 for k in valid), tally
    assert tally.rejected["invalid"] == tally.sent["invalid"] > 0
    assert tally.gave_up["abort"] == tally.sent["abort"] > 0
    assert tally.gave_up["disconnect"] == tally.sent["disconnect"] > 0
    assert not probe.failures and probe.max_latency < HEALTH_BOUND_S, probe.failures[:5]
    # the engine noticed the clients that left, and only those
    assert wait_for(
        lambda: engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == 0
    )
    after = engine.stats()
    aborted = after["requests_aborted_total"] - before["requests_aborted_total"]
    num_left = tally.gave_up["abort"] + tally.gave_up["disconnect"]
    # each client that left had its request aborted (at most 1% may have left before the
    # server read their request, which then never reached the engine)
    assert 0 < aborted <= num_left, (aborted, num_left)
    assert num_left - aborted <= num_left // 100, f"{num_left} clients left, {aborted} aborts"
    assert after["requests_failed_total"] == before["requests_failed_total"]
    # nothing leaked
    engine.check_integrity()
    inflight = soaked.app.state.server.inflight
    assert wait_for(lambda: sum(inflight.values()) == 0), dict(inflight)
    engine.flush_cache()
    stats = engine.stats()
    assert stats["kv_slots_used"] == 0 and stats["cache_tokens"] == 0, stats
    engine.check_integrity()
    # memory flat
    growth = rss["end"] - rss["early"]
    assert growth < RSS_GROWTH_BOUND, f"RSS grew {growth >> 20} MiB during the soak"
