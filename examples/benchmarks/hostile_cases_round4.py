"""The fourth round's hostile cases (issue 50) for hostile_bench.py --round4: one case per
finding, each measured, not only judged.

Kinds of case, and what is measured:
- stall: tenant A attacks; tenant B's 1-token /generate plus a tokenize every PROBE_EVERY_S,
  and /health from a process of its own, the slowest of each while the attack runs (each
  observation capped: "> 30 s" means it had not answered then). Goal: within 2x of the same
  server with no attack (the "quiet" row, measured in the same run; floored at
  QUIET_FLOOR_S, the noise of a shared machine) and /health <= 1 s.
- leak: the server's resident memory (VmRSS) before, after the attack and after /flush_cache.
  Goal: flat (at most LEAK_TOLERANCE_MB more after the flush).
- poison: an answer after the disk tier was tampered with, against a fresh computation (the
  same server's first answer from an empty directory, or a server started on an empty one).
  Goal: identical.
- answer: statuses and whether the answer is the expected one.

The cases live on server variants (SERVERS): "tenants" (two tenants' keys and an admin key),
"variants" (also --eviction-policy graph --reasoning-parser think --host-kv-gb 1), "disk"
(--disk-kv-dir, write-through) and "own" (cases that start their own servers or scripts).
The answer cases are in hostile_cases_round4_answers.py, the disk tier's and the own cases
in hostile_cases_round4_disk.py; the runner is hostile_round4.py.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from hostile_cases_tenants import KEYS, auth

PROBE_CAP_S = 30.0  # an observation past this is reported as "> 30 s"
ATTACK_CAP_S = 30.0  # the attack's time that is watched (its clients give up later)
PROBE_EVERY_S = 0.5
QUIET_FLOOR_S = 0.25
LEAK_TOLERANCE_MB = 16.0
ONE_TOKEN = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
_PROBES = itertools.count()
CHAT = "/v1/chat/completions"
ADMIN = {"authorization": f"Bearer {KEYS['admin']}"}


@dataclass
class Target:
    """What a case acts on: the server's address and process, its /health watch, and how to
    start more servers (`launch(flags) -> server`, the "own" cases)."""

    url: str
    pid: int
    health: Callable[[], float]  # the slowest /health since the last call
    launch: Callable[..., Any]
    disk_dir: str = ""
    work_dir: str = "/tmp"
    tree: str = "."


@dataclass(frozen=True)
class Round4Case:
    finding: str  # "#1" .. "#15", "extra"
    name: str
    kind: str  # stall | leak | poison | answer
    server: str  # tenants | variants | disk | own
    run: Callable[[Target], dict]


def post(url: str, path: str, body: dict, tenant: str = "a", timeout: float = 60) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=auth(tenant), timeout=timeout)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """The process's resident memory (or VmHWM, its peak) in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------ measuring a stall


def victim_once(url: str) -> float:
    """Tenant B's 1-token request on a new 3-token prompt (new work, not a cache read) and a
    tokenize: seconds, PROBE_CAP_S if not answered."""
    n = next(_PROBES)
    body = {**ONE_TOKEN, "input_ids": [1000 + n % 30000, 2 + n // 30000, 3]}
    started = time.monotonic()
    try:
        post(url, "/generate", body, "b", timeout=PROBE_CAP_S)
        left = max(0.1, PROBE_CAP_S - (time.monotonic() - started))
        post(url, "/v1/flowlang/tokenize", {"text": "a victim"}, "b", timeout=left)
    except httpx.HTTPError:
        return PROBE_CAP_S
    return min(PROBE_CAP_S, time.monotonic() - started)


def watch_victim(url: str, busy: Callable[[], bool], tail_s: float = 0.0) -> float:
    """Probe as tenant B while `busy()` (at least 3 probes, at most ATTACK_CAP_S), then for
    `tail_s` more: the slowest probe."""
    worst, begun, probes = 0.0, time.monotonic(), 0
    while (probes < 3 or busy()) and time.monotonic() - begun < ATTACK_CAP_S:
        worst = max(worst, victim_once(url))
        probes += 1
        time.sleep(PROBE_EVERY_S)
    tail_end = time.monotonic() + tail_s
    while time.monotonic() < tail_end:
        worst = max(worst, victim_once(url))
        time.sleep(PROBE_EVERY_S)
    return worst


def in_threads(calls: list[Callable[[], Any]]) -> Callable[[], bool]:
    """Start each call in a daemon thread; returns whether any still runs."""
    threads = [threading.Thread(target=_quietly(c), daemon=True) for c in calls]
    for thread in threads:
        thread.start()
    return lambda: any(t.is_alive() for t in threads)


def _quietly(call: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            call()
        except httpx.HTTPError:
            pass  # the attacker gives up: only the others' time is measured

    return run


def stall(attack: Callable[[Target], Callable[[], bool]], tail_s: float = 0.0):
    """A stall case's run: start `attack` (it returns whether it still runs), watch."""

    def run(target: Target) -> dict:
        target.health()
        busy = attack(target)
        victim_s = watch_victim(target.url, busy, tail_s)
        return {"victim_s": victim_s, "health_s": target.health()}

    return run


def attack_posts(path: str, bodies: list[dict], sequential: bool = False, stream: bool = False):
    """An attack of tenant A: `bodies` posted to `path` at once (or one after another)."""

    def attack(target: Target) -> Callable[[], bool]:
        calls = [_poster(target.url, path, b, stream) for b in bodies]
        if sequential:
            return in_threads([lambda: [c() for c in calls]])
        return in_threads(calls)

    return attack


def _poster(url: str, path: str, body: dict, stream: bool) -> Callable[[], None]:
    def call() -> None:
        if not stream:
            post(url, path, body, timeout=ATTACK_CAP_S + 30)
            return
        with httpx.stream(
            "POST", url + path, json=body, headers=auth("a"), timeout=ATTACK_CAP_S + 30
        ) as response:
            for _ in response.iter_lines():
                pass

    return call


# ------------------------------------------------------------------ the stall cases


def _slow_template(iterations_inner: int) -> str:
    """A chat template that loops 100,000 x `iterations_inner` times (jinja's sandbox caps
    one range at 100,000, not two nested ones) and renders "x"."""
    return (
        "{% for i in range(100000) %}{% for j in range(" + str(iterations_inner) + ") %}"
        "{% endfor %}{% endfor %}x"
    )


def template_bodies() -> list[dict]:
    """#1: six chats whose chat_template_kwargs carry their own template, ~5e7 loops each
    (the issue's were ~1e10: 30 minutes)."""
    return [
        {
            "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": 1,
            "chat_template_kwargs": {"chat_template": _slow_template(500 + i)},
        }
        for i in range(6)
    ]


def function_call_text() -> dict:
    """#2: /parse_function_call, llama3, 24 kB of `[{"name": ` (each opening's JSON runs to
    the end of the text before it fails: quadratic)."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return {"text": '[{"name": ' * 2400 + "x", "tools": [tool], "tool_call_parser": "llama3"}


def forced_stop_regex() -> dict:
    """#3: an ebnf forcing 2,000 characters (jump-forward feeds them in few steps), n 4, and a
    stop_regex whose matcher costs ~1,000 steps a character."""
    forced = "ab" * 1000
    sampling = {"max_new_tokens": 4000, "ebnf": f'root ::= "{forced}"', "n": 4}
    return {"text": "Hi", "sampling_params": {**sampling, "stop_regex": [".{0,1020}Q"]}}


def hinted_generate() -> dict:
    """#5: a 300-token generation hinting 1e9 future tokens (graph eviction's in-flight work)."""
    hints = {"program_id": uuid.uuid4().hex, "continuation": True, "future_tokens": 10**9}
    sampling = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0}
    return {"input_ids": list(range(1000, 1100)), "sampling": sampling, "hints": hints}


def slow_tool_chats() -> list[dict]:
    """#6: 4 chats, each with a new tool parameter `pattern` that takes seconds to compile."""
    return [
        {
            "messages": [{"role": "user", "content": "Look it up."}],
            "max_tokens": 1,
            "tools": [tool_spec("lookup", {"q": {"type": "string", "pattern": f"[^x]{{0,{n}}}"}})],
            "tool_choice": "auto",
        }
        for n in (2800, 2810, 2820, 2830)
    ]


def tool_spec(name: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required or []}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def huge_null_max_tokens() -> list[dict]:
    """#7: SGLang /generate, max_new_tokens null, 7.4 MB of text, twice."""
    body = {"text": "lorem ipsum " * 620_000, "sampling_params": {"max_new_tokens": None}}
    return [body, body]


STALLS = [
    Round4Case(
        "#1",
        "chat_template_kwargs: own template x6",
        "stall",
        "tenants",
        stall(attack_posts(CHAT, template_bodies())),
    ),
    Round4Case(
        "#2",
        "parse_function_call llama3 24 kB",
        "stall",
        "tenants",
        stall(attack_posts("/parse_function_call", [function_call_text()])),
    ),
    Round4Case(
        "#3",
        "ebnf jump-forward + stop_regex, n 4",
        "stall",
        "tenants",
        stall(attack_posts("/generate", [forced_stop_regex()])),
    ),
    Round4Case(
        "#6",
        "tools with slow patterns x4",
        "stall",
        "tenants",
        stall(attack_posts(CHAT, slow_tool_chats(), sequential=True)),
    ),
    Round4Case(
        "#7",
        "SGLang 7.4 MB text, max_new_tokens null",
        "stall",
        "tenants",
        stall(attack_posts("/generate", huge_null_max_tokens(), sequential=True)),
    ),
    Round4Case(
        "#5",
        "graph hint future_tokens 1e9",
        "stall",
        "variants",
        stall(attack_posts("/v1/flowlang/generate", [hinted_generate()], stream=True), 3.0),
    ),
]


# ------------------------------------------------------------------ leaks


def leak(attack: Callable[[str], dict], warm: Callable[[str], object] = lambda url: None):
    """A leak case's run: RSS before (once `warm(url)` has filled what may fill), after
    `attack(url)` and after /flush_cache."""

    def run(target: Target) -> dict:
        warm(target.url)
        before = rss_mb(target.pid)
        extra = attack(target.url)
        after = rss_mb(target.pid)
        httpx.post(target.url + "/flush_cache", headers=ADMIN, timeout=60)
        time.sleep(1.0)
        flushed = rss_mb(target.pid)
        return {"rss_before_mb": before, "rss_after_mb": after, "rss_flushed_mb": flushed, **extra}

    return run


def _many(url: str, path: str, bodies: list[dict], threads: int = 4) -> dict:
    """Post `bodies` from `threads` threads: how many got a 200."""
    statuses: list[int] = []
    todo = list(reversed(bodies))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                body = todo.pop()
            try:
                with httpx.stream(
                    "POST", url + path, json=body, headers=auth("a"), timeout=120
                ) as response:
                    response.read()
                    statuses.append(response.status_code)
            except httpx.HTTPError:
                statuses.append(0)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return {"requests": len(bodies), "ok": statuses.count(200)}


def namespaces(url: str) -> dict:
    """#4: 60 requests, each with its own 1 MB extra_key."""
    name = "n" * (1 << 20)
    sampling = {"max_new_tokens": 1}
    ids = list(range(100, 164))  # whole pages: something is cached under each name
    bodies = [
        {"input_ids": ids, "sampling_params": sampling, "extra_key": f"{name}{i}"}
        for i in range(60)
    ]
    return _many(url, "/generate", bodies)


RETURN_PREFIX = list(range(2000, 5900))


def warm_prefix(url: str) -> None:
    """The shared prefix computed and flushed once (its chunks are in host memory before), then
    150 requests of the attack's shape without hints: the server's memory reaches its working
    size first (measured: +59 MB over the first 150 requests, flat after), so what the attack
    adds is what the hints keep."""
    _many(
        url, "/generate", [{"input_ids": RETURN_PREFIX, "sampling_params": {"max_new_tokens": 1}}]
    )
    httpx.post(url + "/flush_cache", headers=ADMIN, timeout=60)
    _many(url, "/v1/flowlang/generate", _returning_bodies(150, hinted=False))


def _returning_bodies(count: int, hinted: bool = True) -> list[dict]:
    """Requests on the 3,900-token prefix, each with a suffix of its own; `hinted`: each a new
    program that declares its return in 1e9 s."""
    tag = 7000 if hinted else 9000
    bodies = [
        {
            "input_ids": [*RETURN_PREFIX, tag + i % 1000, 8000 + i // 1000],
            "sampling": {"max_new_tokens": 1},
        }
        for i in range(count)
    ]
    for body in bodies if hinted else []:
        body["hints"] = {
            "program_id": uuid.uuid4().hex,
            "continuation": True,
            "next_turn_after_s": 1e9,
        }
    return bodies


def returning_branches(url: str) -> dict:
    """#10: 300 requests, each a new program that declares its return in 1e9 s (a KV tier is
    on: the returning-branches table keeps its token ids)."""
    return _many(url, "/v1/flowlang/generate", _returning_bodies(300))


def padding_peak(target: Target) -> dict:
    """#1: chat_template_kwargs padding to 2e7 tokens from a ~150-byte body: the peak RSS
    (VmHWM) before and after, and the status."""
    before = rss_mb(target.pid, "VmHWM")
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"padding": "max_length", "max_length": 20_000_000},
    }
    response = post(target.url, CHAT, body, timeout=120)
    return {
        "status": response.status_code,
        "peak_before_mb": before,
        "peak_after_mb": rss_mb(target.pid, "VmHWM"),
    }


LEAKS = [
    Round4Case("#4", "60 x 1 MB namespaces", "leak", "tenants", leak(namespaces)),
    Round4Case("#1", "chat_template_kwargs padding 2e7", "leak", "tenants", padding_peak),
    Round4Case(
        "#10",
        "300 returns declared in 1e9 s",
        "leak",
        "variants",
        leak(returning_branches, warm_prefix),
    ),
]
