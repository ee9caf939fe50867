"""The cases of hostile_bench.py: what a hostile client sends, by category, and how each should
end. A case's outcome is the status it got ("400"), "hang" (nothing within HANG_S, or a
connection held that long), "closed" (the server closed the connection unanswered) or "gone"
(the client left on purpose)."""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

Outcome = str
HANG_S = 20.0
SURROGATE = "a\\ud800b"  # a lone surrogate as JSON carries it
CHAT = "/v1/chat/completions"
LONG = {"max_new_tokens": 1000, "ignore_eos": True}


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable[[str], Outcome]
    expect: tuple[str, ...]  # outcome prefixes that are right: "4" is any 4xx
    process: bool = False  # run() takes the ServerProcess (it signals it), not its URL

    def is_expected(self, outcome: Outcome) -> bool:
        return outcome.startswith(self.expect)


def post(path: str, body: dict | str | Callable[[], Iterator[bytes]]) -> Callable[[str], Outcome]:
    """A case that posts `body` (a dict as JSON, a str as it is, or a chunk generator)."""

    def run(url: str) -> Outcome:
        if isinstance(body, dict):
            content = json.dumps(body).encode()
        elif isinstance(body, str):
            content = body.encode("latin-1")  # "\xff" stays one byte: not UTF-8
        else:
            content = body()
        headers = {"content-type": "application/json"}
        try:
            response = httpx.post(url + path, content=content, headers=headers, timeout=HANG_S)
        except httpx.TimeoutException:
            return "hang"
        except httpx.TransportError:
            return "closed"
        return str(response.status_code)

    return run


def gen(**sampling) -> dict:
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **sampling}}


def score(continuations: list) -> dict:
    return {"prefix": [1, 2, 3], "continuations": continuations}


def user(content: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": content}]})


def malformed() -> list[Case]:
    s = SURROGATE
    bodies = {
        "lone surrogate /generate": ("/generate", f'{{"text": "{s}"}}'),
        "lone surrogate completions": ("/v1/completions", f'{{"prompt": "{s}"}}'),
        "lone surrogate chat": (CHAT, user(s).replace("\\\\", "\\")),
        "lone surrogate tokenize": ("/v1/flowlang/tokenize", f'{{"text": "{s}"}}'),
        "lone surrogate score": (
            "/v1/flowlang/score",
            f'{{"prefix": "{s}", "continuations": [[1]]}}',
        ),
        "content part text 7": (CHAT, '{"messages": [{"role": "user", "content": [{"text": 7}]}]}'),
        "temperature Infinity": ("/generate", gen(temperature="Infinity")),
        "completions prompt []": ("/v1/completions", '{"prompt": []}'),
        "not JSON": ("/generate", "{'text': nope"),
        "not UTF-8": ("/generate", '{"text": "\xff"}'),
        "max_new_tokens -5": ("/generate", gen(max_new_tokens=-5)),
        "n 10000": ("/v1/completions", {"prompt": "hi", "n": 10000}),
        "10,000 stop strings": ("/generate", gen(stop=[f"s{i}" for i in range(10_000)])),
        "top_logprobs 1e9": (
            CHAT,
            {**json.loads(user("hi")), "logprobs": 1, "top_logprobs": 10**9},
        ),
        "input_ids []": ("/generate", {"input_ids": []}),
    }
    cases = [Case("malformed", n, post(p, b), ("4",)) for n, (p, b) in bodies.items()]
    cases.append(Case("malformed", "unknown route", _get("/no/such/route"), ("4",)))
    return cases


def _get(path: str) -> Callable[[str], Outcome]:
    return lambda url: str(httpx.get(url + path, timeout=HANG_S).status_code)


def poison() -> list[Case]:
    """Requests that once failed the forward pass or the sampler for every request in the step
    (or killed the engine): each runs alongside valid requests, which must all succeed."""
    bodies = {
        "score continuation [[-1]]": ("/v1/flowlang/score", score([[-1]])),
        "score continuation [[-5, 3]]": ("/v1/flowlang/score", score([[-5, 3]])),
        "score continuation past vocab": ("/v1/flowlang/score", score([[49152]])),
        "score continuation 1e12": ("/v1/flowlang/score", score([[10**12]])),
        "input_ids [-1, 2]": ("/generate", {"input_ids": [-1, 2]}),
        "input_ids past vocab": ("/generate", {"input_ids": [49152]}),
        "stop_token_ids [-3]": ("/generate", gen(stop_token_ids=[-3])),
        "temperature 1e-45": ("/generate", gen(temperature=1e-45)),
        "top_p 1e-300": ("/generate", gen(top_p=1e-300)),
        "repetition_penalty 1e-40": ("/generate", gen(repetition_penalty=1e-40)),
    }
    return [
        Case("poison", name, alongside_others(post(path, body)), ("2", "4"))
        for name, (path, body) in bodies.items()
    ]


def alongside_others(case: Callable[[str], Outcome]) -> Callable[[str], Outcome]:
    """Run `case` while 4 valid requests are in flight; any of those failing makes it "500"."""

    def run(url: str) -> Outcome:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 24}}
        statuses: list[int] = []

        def valid() -> None:
            statuses.append(httpx.post(url + "/generate", json=body, timeout=60).status_code)

        others = [threading.Thread(target=valid) for _ in range(4)]
        for thread in others:
            thread.start()
        time.sleep(0.2)
        outcome = case(url)
        for thread in others:
            thread.join()
        return outcome if statuses == [200] * 4 else "500"

    return run


def resources() -> list[Case]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(8)) for _ in range(110_000)]
    many_states = "(" + "|".join(f"(a|b)*c{{{i}}}" for i in range(1, 1500)) + ")"
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}
    recursive = {"$defs": {"node": {**node, "required": ["child"]}}, "$ref": "#/$defs/node"}

    def chunks() -> Iterator[bytes]:
        for _ in range(20):  # no Content-Length: 20 MB against the 8 MB limit
            yield b" " * (1 << 20)

    bodies = {
        "7.9 MB prompt": ({"text": "lorem ipsum " * 660_000}, "4"),
        "20 MB chunked body": (chunks, "413"),
        "1 MB regex": (gen(regex="(" + "|".join(words) + ")"), "4"),
        "recursive JSON schema": (gen(json_schema=json.dumps(recursive), max_new_tokens=64), "4"),
        "20 kB regex, 60 MiB compiled": (gen(regex=many_states), "4"),
    }
    return [Case("resource", n, post("/generate", b), (e,)) for n, (b, e) in bodies.items()]


def disconnects() -> list[Case]:
    """Clients that leave before their answer: their work must stop (else a leak)."""
    chat = {"messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 1000}
    bodies = {
        "8 clients leave /generate": ("/generate", {"text": "Tell me", "sampling_params": LONG}),
        "8 clients leave completions": (
            "/v1/completions",
            {"prompt": "Tell me", "max_tokens": 1000, "ignore_eos": True},
        ),
        "8 clients leave chat": (CHAT, {**chat, "ignore_eos": True}),
    }
    cases = [Case("disconnect", n, leave(p, b, 8), ("gone",)) for n, (p, b) in bodies.items()]
    conts = [[100 + i] + [5 + (i * 7 + j) % 400 for j in range(1500)] for i in range(24)]
    body = score(conts)
    cases += [
        Case(
            "disconnect",
            "a client leaves its score",
            leave("/v1/flowlang/score", body, 1),
            ("gone",),
        ),
        Case("disconnect", "20 connections reset", reset_connections(20), ("gone",)),
    ]
    return cases


def leave(path: str, body: dict, num_clients: int) -> Callable[[str], Outcome]:
    """`num_clients` post `body` and give up after 1 s."""

    def run(url: str) -> Outcome:
        outcomes: list[Outcome] = []

        def one() -> None:
            try:
                outcomes.append(str(httpx.post(url + path, json=body, timeout=1.0).status_code))
            except httpx.TimeoutException:
                outcomes.append("gone")

        threads = [threading.Thread(target=one) for _ in range(num_clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return max(outcomes, key=lambda o: o != "gone")  # a status, if one came back

    return run


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HANG_S)


def reset_connections(num: int) -> Callable[[str], Outcome]:
    """Requests whose connection is reset (not closed) 50 ms after they were sent."""

    def run(url: str) -> Outcome:
        body = json.dumps({"text": "Tell me", "sampling_params": LONG}).encode()
        head = f"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
        for _ in range(num):
            sock = _connect(url)
            sock.sendall(head.encode() + body)
            time.sleep(0.05)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        return "gone"

    return run


def slow_clients() -> list[Case]:
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200
    body_head = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 500\r\n\r\n"
    return [
        Case("slow", "headers a byte every 0.25 s", dribble(head), ("408", "closed")),
        Case("slow", "connection that sends nothing", dribble(b""), ("408", "closed")),
        Case("slow", "body a byte every 0.25 s", dribble(body_head, b"{" + b" " * 499), ("408",)),
    ]


def dribble(first: bytes, slowly: bytes | None = None) -> Callable[[str], Outcome]:
    """Send `first` a byte at a time (or `slowly` so, after `first` at once), 4 bytes a
    second, until the server answers or closes; "hang" if it still holds the connection after
    2 * HANG_S. With nothing to send, just wait."""

    def run(url: str) -> Outcome:
        data, at_once = (first, b"") if slowly is None else (slowly, first)
        with _connect(url) as sock:
            sock.sendall(at_once)
            sock.settimeout(0.25)
            deadline = time.monotonic() + 2 * HANG_S
            while time.monotonic() < deadline:
                try:
                    if data:
                        sock.send(data[:1])
                        data = data[1:] or b" "
                    answer = sock.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return "closed"
                return answer.split(b" ")[1].decode() if answer else "closed"
        return "hang"

    return run


def stream_failures() -> list[Case]:
    """Streams whose request fails once streaming began (crowded out by pins: busy, 503):
    the last frame must say so with 503, never end as if the request had succeeded."""
    ids = list(range(1000, 3500))  # 2,504 slots of 4,096 with 2,000 pinned: crowded out
    return [
        Case(
            "stream",
            "SGLang stream crowded out",
            crowded("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}),
            ("503",),
        ),
        Case(
            "stream",
            "completions stream crowded out",
            crowded("/v1/completions", {"prompt": ids, "max_tokens": 4}),
            ("503",),
        ),
        Case(
            "stream",
            "chat stream crowded out",
            crowded(CHAT, {**json.loads(user("hello " * 2500)), "max_tokens": 4}),
            ("503",),
        ),
    ]


def crowded(path: str, body: dict) -> Callable[[str], Outcome]:
    """Pin 2,000 tokens, then stream `body`: the error frame's code, or "200" if the stream
    ended as a success (or the status, if it never started)."""

    def run(url: str) -> Outcome:
        with httpx.Client(base_url=url, timeout=HANG_S) as client:
            pin = client.post("/v1/flowlang/pin", json={"prefix_ids": list(range(1, 2001))})
            if pin.status_code != 200:
                return f"pin {pin.status_code}"
            try:
                with client.stream("POST", path, json={**body, "stream": True}) as response:
                    if response.status_code != 200:
                        return str(response.status_code)
                    frames = [x[6:] for x in response.iter_lines() if x.startswith("data: ")]
            finally:
                client.delete(f"/v1/flowlang/pin/{pin.json()['pin_id']}")
        errors = [json.loads(f)["error"] for f in frames if f.startswith('{"error"')]
        return str(errors[-1].get("code", 500)) if errors else "200"

    return run


CASES = [*malformed(), *poison(), *resources(), *disconnects(), *slow_clients(), *stream_failures()]
