"""Hypothesis against every route of two live servers (one open, one with API keys): bodies
built from each route's real field names, half of them valid and half with hostile values
(wrong types, huge, negative and non-finite numbers, numbers as strings, empty and nested junk,
texts up to 100 kB, lone surrogates sent as JSON escapes, unknown fields); arbitrary JSON on
any route; raw bytes that are not JSON at all.

Whatever arrives: no 5xx (a client mistake is a 4xx; only "busy, retry later" may be a 503,
and it must say when to retry), every answer within a deadline, a stream that starts also ends
with [DONE] and carries no server error, and /health answers throughout. Afterwards the
engines are intact: nothing running or waiting, slots conserved, no slot leaked once the pins
are gone, and a greedy control request gives what it gave before the fuzzing."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import ServerThread
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import GenerateRequest, SamplingParams, ScoreRequest
from runtime.server.flowlang_api import PinBody, TokenizeBody
from runtime.server.schemas import ChatBody, CompletionBody
from runtime.server.sglang_ops import ConcatenateBody, ProfileBody
from runtime.server.sglang_schemas import GenerateBody, SGLangSamplingParams

VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer)
USER, ADMIN = "fuzz-user", "fuzz-admin"
DEADLINE_S = 30.0  # every answer, streams included, arrives within this
HEALTH_BOUND_S = 5.0  # /health answers within this while the fuzzing runs
MAX_BODY_BYTES = 1_000_000
CONTROL = {
    "input_ids": [1, 504, 3094, 282, 253, 1167],
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
}

FUZZ = settings(
    deadline=None,  # the deadline that matters is the server's, checked per request
    database=None,
    # no shrinking: the servers keep state, so the first failing example (with the requests
    # before it, which `send` reports) tells more than a shrunk one replayed on a changed server
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


# ---------------------------------------------------------------- the servers under fuzzing
@dataclass
class Fuzzed:
    """An engine behind a server, and its greedy control output from before the fuzzing."""

    name: str
    thread: ServerThread
    headers: dict[str, str]  # what a well-behaved client of this server sends
    client: httpx.Client  # what the fuzzing sends with
    control: list[int] = field(default_factory=list)

    @property
    def engine(self) -> Engine:
        return self.thread.engine


class HealthProbe(threading.Thread):
    """Asks every server's /health ten times a second; keeps the slowest answer and failures."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.stopping = threading.Event()
        self.max_latency = 0.0
        self.num_probes = 0
        self.failures: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stopping.is_set():
                for url in self.urls:
                    started = time.monotonic()
                    try:
                        response = client.get(url + "/health")
                        if response.status_code != 200:
                            self.failures.append(f"{url}: {response.status_code} {response.text}")
                    except httpx.HTTPError as err:
                        self.failures.append(f"{url}: {err!r}")
                    self.max_latency = max(self.max_latency, time.monotonic() - started)
                    self.num_probes += 1
                self.stopping.wait(0.1)

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)


@dataclass
class Servers:
    """The servers under fuzzing, their /health probe, and what the fuzzing saw."""

    by_name: dict[str, Fuzzed]
    probe: HealthProbe
    outcomes: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route, status)
    history: deque[str] = field(default_factory=lambda: deque(maxlen=4))  # the last requests

    def __getitem__(self, name: str) -> Fuzzed:
        return self.by_name[name]


def control_output(server: Fuzzed) -> list[int]:
    with httpx.Client(base_url=server.thread.url, timeout=60, headers=server.headers) as client:
        response = client.post("/generate", json=CONTROL)
    assert response.status_code == 200, response.text
    return response.json()["output_ids"]


@contextlib.contextmanager
def started_servers(model_dir) -> Iterator[Servers]:
    """Two small engines behind two servers, one open and one with user and admin keys; a
    probe asks both for /health throughout. Each fuzzing request says `Connection: close`: a
    server that breaks off one exchange cannot fail the next example on a dead connection."""
    by_name = {}
    for name, keys in (("open", {}), ("keyed", {"api_keys": (USER,), "admin_keys": (ADMIN,)})):
        engine = Engine(EngineConfig(model=str(model_dir), max_kv_tokens=8000))
        thread = ServerThread(engine, pin_lease_seconds=1.0, max_body_bytes=MAX_BODY_BYTES, **keys)
        headers = {"Authorization": f"Bearer {USER}"} if keys else {}
        client = httpx.Client(
            base_url=thread.url, timeout=DEADLINE_S, headers={"connection": "close"}
        )
        by_name[name] = Fuzzed(name, thread, headers, client)
    for server in by_name.values():
        server.control = control_output(server)
    probe = HealthProbe([s.thread.url for s in by_name.values()])
    probe.start()
    try:
        yield Servers(by_name, probe)
    finally:
        probe.stop()
        for server in by_name.values():
            server.client.close()
            server.thread.stop()


@pytest.fixture
def fresh(tiny_model_dir):
    """New servers for one fuzzing run: a failure in one run cannot leak into the next."""
    with started_servers(tiny_model_dir) as servers:
        yield servers


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    """Servers for the explicit cases, one after the other."""
    with started_servers(tiny_model_dir) as servers:
        yield servers


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def assert_intact(servers: Servers) -> None:
    """/health answered throughout, nothing is left running or waiting, slots are conserved,
    nothing leaked once the pins are gone, and the control output is unchanged."""
    probe = servers.probe
    print(f"/health: {probe.num_probes} probes, the slowest {probe.max_latency:.3f} s")
    assert probe.num_probes > 0 and not probe.failures, probe.failures[:5]
    assert probe.max_latency < HEALTH_BOUND_S, f"/health took {probe.max_latency:.2f} s"
    for server in servers.by_name.values():
        engine = server.engine
        assert wait_for(lambda e=engine: e.stats()["num_running"] == 0), engine.stats()
        assert wait_for(lambda e=engine: e.stats()["num_waiting"] == 0), engine.stats()
        engine.check_integrity()
        server.thread.app.state.server.leases.release_all()  # pins whose lease still runs
        assert wait_for(lambda e=engine: e.stats()["num_pins"] == 0), engine.stats()
        engine.flush_cache()
        stats = engine.stats()
        assert stats["kv_slots_used"] == 0 and stats["cache_tokens"] == 0, stats
        engine.check_integrity()
        assert control_output(server) == server.control, f"{server.name}: greedy output changed"


# ---------------------------------------------------------------- hostile values
plain_text = st.text(max_size=24)  # any code point but lone surrogates
surrogate_text = st.builds(
    lambda a, s, b: a + s + b,
    plain_text,
    st.sampled_from(["\ud800", "\udfff", "\udc00\ud800"]),
    plain_text,
)
long_text = st.builds(
    lambda unit, n: (unit * n)[:n],
    st.text(min_size=1, max_size=4),
    st.sampled_from([2_000, 20_000, 100_000]),
)
numeric_strings = st.sampled_from(
    ["NaN", "nan", "Infinity", "-Infinity", "1e309", "-1", "0", "2", "1.5", " 3", "0x10", "1_0",
     "", "null", "true", "\u0663", "9" * 400]
)  # fmt: skip
odd_numbers = st.one_of(
    st.sampled_from([-1, 0, 2**31, -(2**63) - 1, 2**63, 2**64, 10**30, 10**400, -0.0, 1e308]),
    st.floats(),  # NaN and +-Infinity travel as Python's JSON extensions, which the server parses
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    odd_numbers,
    numeric_strings,
    plain_text,
    surrogate_text,
)
junk = st.recursive(
    scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.one_of(plain_text, surrogate_text), kids, max_size=4),
    ),
    max_leaves=10,
)
hostile = st.one_of(junk, long_text, surrogate_text, st.just([]), st.just({}), st.just([[]]))
unknown_names = st.sampled_from(
    ["foo", "", "__proto__", "text ", "TEXT", "sampling_params.n", "\ud800"]
)


@dataclass(frozen=True)
class F:
    """A field: the values a valid request may give, and typed values that break it."""

    valid: st.SearchStrategy
    edge: st.SearchStrategy = st.nothing()


@st.composite
def body_of(
    draw: st.DrawFn,
    model: Any,
    fields: dict[str, F],
    required: tuple[str, ...] = (),
    exclusive: tuple[str, ...] = (),
    one_needed: bool = False,
) -> dict:
    """A body for `model`: required fields and some optional ones, valid values only, at most
    one of `exclusive` (exactly one if `one_needed`). Half of the bodies are then broken:
    a field or two dropped or given an edge or hostile value, and maybe a field `fields` leaves
    out (unsupported, ignored) or an unknown one."""
    optional = {k: f.valid for k, f in fields.items() if k not in required and k not in exclusive}
    body = draw(st.fixed_dictionaries({k: fields[k].valid for k in required}, optional=optional))
    if exclusive:
        choices = list(exclusive) if one_needed else [None, *exclusive]
        for name in exclusive:
            body.pop(name, None)
        chosen = draw(st.sampled_from(choices))
        if chosen is not None:
            body[chosen] = draw(fields[chosen].valid)
    if not draw(st.booleans()):
        return body
    for name in draw(
        st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)
    ):
        how = draw(st.sampled_from(["edge", "hostile", "drop"]))
        if how == "drop":
            body.pop(name, None)
        else:
            body[name] = draw(st.one_of(fields[name].edge, hostile) if how == "edge" else hostile)
    others = sorted(set(model.model_fields) - set(fields))
    extras = st.one_of(unknown_names, st.sampled_from(others)) if others else unknown_names
    for name in draw(st.lists(extras, max_size=2, unique=True)):
        body[name] = draw(hostile)
    return body


def once_or_listed(strategy: st.SearchStrategy, max_size: int = 3) -> st.SearchStrategy:
    return st.one_of(strategy, st.lists(strategy, min_size=1, max_size=max_size))


token = st.integers(0, VOCAB - 1)
token_ids = F(
    st.one_of(
        st.lists(token, min_size=1, max_size=12),
        st.builds(lambda t, n: [t] * n, token, st.sampled_from([600, 7_900])),  # most of the pool
    ),
    st.one_of(
        st.just([]),
        st.builds(lambda t, n: [t] * n, token, st.sampled_from([8_001, 9_000, 50_000])),
        st.lists(st.sampled_from([VOCAB, -1, 2**40, 1.5, True]), min_size=1, max_size=2).map(
            lambda bad: [5, *bad]
        ),
    ),
)
prompt_text = F(
    st.one_of(
        st.sampled_from(
            ["Hello", "Once upon a time", " ", "\x00", "<|im_start|>user\nhi<|im_end|>"]
        ),
        plain_text,
        long_text,
    ),
    st.one_of(surrogate_text, st.just("")),
)
texts = F(plain_text, surrogate_text)
few_tokens = F(st.integers(0, 8), st.sampled_from([-1, 8_193, 2**31, 2**63, 1.5, "4"]))
some_tokens = F(st.integers(1, 8), few_tokens.edge | st.just(0))
flag = F(st.booleans(), st.sampled_from([0, 1, "true", "yes", None]))
regex = F(
    st.sampled_from(["[a-z]+", "\\d{3}-\\d{4}", "(yes|no)", "x*", "[^\\n]{0,5}", "(a|aa)*b"]),
    st.sampled_from(
        ["(a+)+$", "a{1000000}", "(", "\\", "(?P<n>a)(?P=n)", ".{0,100000}", "\\p{L}+", "", "[",
         "(?=a)b", "a{2,1}", "[z-a]"]
    ),
)  # fmt: skip
schema = F(
    st.sampled_from(
        [
            {"type": "object"},
            {"type": "string", "maxLength": 5},
            {"enum": ["a", "b"]},
            {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
                "required": ["ok", "tag"],
            },
        ]
    ),
    st.one_of(
        st.sampled_from(
            [
                {"$ref": "#"},
                {"type": "array", "items": {"$ref": "#"}},
                {"type": "string", "pattern": "(a+)+$"},
                {"type": "array", "minItems": 1_000_000},
                {"type": "integer", "minimum": 10, "maximum": 1},
                {"type": "string", "minLength": 100_000},
                {"enum": []},
                {"type": "nope"},
                {"properties": {"a": {"$ref": "#/definitions/missing"}}},
            ]
        ),
        st.dictionaries(st.sampled_from(["type", "properties", "items", "$ref", "enum"]), junk),
    ),
)
grammar = F(
    st.sampled_from(['root ::= "yes" | "no"', "root ::= [a-z]+", 'root ::= "a"*']),
    st.sampled_from(
        ["root ::= root", 'root ::= a\na ::= a "x"', "root ::=", "root ::= [a-z]{1000000}",
         "garbage", 'root ::= "\ud800"']
    ),
)  # fmt: skip
stops = F(
    st.one_of(
        st.text(min_size=1, max_size=8), st.lists(st.text(min_size=1, max_size=8), max_size=4)
    ),
    st.one_of(
        st.just(""), st.just([""]), st.builds(lambda n: ["x"] * n, st.sampled_from([65, 1000]))
    ),
)
stop_regexes = F(
    st.one_of(regex.valid, st.lists(regex.valid, max_size=3)),
    st.one_of(regex.edge, st.lists(regex.edge, min_size=1, max_size=2), st.just(["x"] * 33)),
)
stop_ids = F(st.lists(token, max_size=4), st.lists(st.integers(), min_size=1, max_size=3))


def floats_in(lo: float, hi: float) -> F:
    edge = st.sampled_from([lo - 1, hi + 1, float("nan"), float("inf"), "1"])
    return F(st.floats(lo, hi), st.one_of(edge, st.floats()))


hints = F(
    st.fixed_dictionaries(
        {},
        optional={
            "program_id": plain_text,
            "branch_id": plain_text,
            "fork_group_id": plain_text,
            "fork_group_size": st.integers(1, 5),
            "priority": st.integers(-5, 5),
            "continuation": st.booleans(),
        },
    ),
    st.one_of(
        st.fixed_dictionaries({"fork_group_size": st.integers(-2, 0)}),
        st.fixed_dictionaries({"priority": odd_numbers}),
        st.fixed_dictionaries({"program_id": surrogate_text}),
        st.fixed_dictionaries({"extra": st.booleans()}),
    ),
)

SGLANG_SAMPLING = {
    "max_new_tokens": few_tokens,
    "min_new_tokens": F(st.integers(0, 2), st.integers(3, 10**6)),
    "temperature": floats_in(0, 5),
    "top_p": F(st.floats(0.01, 1), st.sampled_from([0, -0.5, 1.01])),
    "top_k": F(st.integers(-1, 100), st.integers(max_value=-2)),
    "min_p": floats_in(0, 1),
    "frequency_penalty": floats_in(-2, 2),
    "presence_penalty": floats_in(-2, 2),
    "repetition_penalty": F(st.floats(0.1, 3), st.sampled_from([0, -1, 1e308])),
    "stop": stops,
    "stop_token_ids": stop_ids,
    "stop_regex": stop_regexes,
    "ignore_eos": flag,
    "skip_special_tokens": flag,
    "no_stop_trim": flag,
    "sampling_seed": F(st.integers(0, 2**32), st.sampled_from([-1, 2**64, 10**30])),
    "regex": regex,
    "json_schema": F(
        schema.valid.map(json.dumps), st.one_of(schema.edge.map(json.dumps), plain_text)
    ),
    "ebnf": grammar,
    "n": F(st.sampled_from([1, 2, 3]), st.sampled_from([0, -1, 256, 257, 2.5])),
}
sglang_sampling = body_of(
    SGLangSamplingParams,
    SGLANG_SAMPLING,
    required=("max_new_tokens",),
    exclusive=("regex", "json_schema", "ebnf"),
)
generate_body = body_of(
    GenerateBody,
    {
        "text": F(once_or_listed(prompt_text.valid), once_or_listed(prompt_text.edge)),
        "input_ids": F(
            st.one_of(token_ids.valid, st.lists(token_ids.valid, min_size=1, max_size=3)),
            st.one_of(token_ids.edge, st.lists(token_ids.edge, max_size=2)),
        ),
        "sampling_params": F(sglang_sampling, st.lists(sglang_sampling, max_size=3)),
        "return_logprob": F(once_or_listed(st.booleans()), flag.edge),
        "logprob_start_len": F(st.integers(-1, 20), st.sampled_from([-2, 10**9, [1, 2, 3, 4]])),
        "top_logprobs_num": F(st.integers(0, 5), st.sampled_from([-1, 21, 10**6])),
        "return_text_in_logprobs": flag,
        "return_prompt_token_ids": flag,
        "stream": flag,
        "rid": F(st.one_of(plain_text.filter(bool), st.just("fixed-rid")), surrogate_text),
        "priority": F(st.integers(-5, 5), odd_numbers),
        "cache_salt": texts,
        "extra_key": texts,
        "namespace": texts,
    },
    required=("sampling_params",),
    exclusive=("text", "input_ids"),
    one_needed=True,
)
OPENAI_SAMPLING = {
    "model": texts,
    "max_tokens": some_tokens,
    "temperature": floats_in(0, 2),
    "top_p": F(st.floats(0.01, 1), st.sampled_from([0, 1.5])),
    "n": F(st.integers(1, 3), st.sampled_from([0, 17, -1])),
    "stop": stops,
    "seed": F(st.integers(0, 2**32), st.sampled_from([-1, 2**64])),
    "frequency_penalty": floats_in(-2, 2),
    "presence_penalty": floats_in(-2, 2),
    "stream": flag,
    "stream_options": F(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}), junk),
    "user": texts,
    "ignore_eos": flag,
    "min_tokens": F(st.integers(0, 1), st.integers(9, 10**6)),
    "namespace": texts,
}
completion_body = body_of(
    CompletionBody,
    {
        **OPENAI_SAMPLING,
        "prompt": F(
            st.one_of(
                prompt_text.valid,
                st.lists(prompt_text.valid, min_size=1, max_size=3),
                token_ids.valid,
                st.lists(token_ids.valid, min_size=1, max_size=3),
            ),
            st.one_of(prompt_text.edge, token_ids.edge, st.just([[]]), st.just([])),
        ),
        "logprobs": F(st.integers(0, 5), st.sampled_from([-1, 6, 10**6])),
        "echo": flag,
    },
    required=("prompt", "max_tokens"),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system"]),
        "content": st.one_of(
            prompt_text.valid,
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}), max_size=3
            ),
        ),
    }
)
bad_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "", "\ud800", "x" * 10_000])}),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.one_of(surrogate_text, st.none())}
    ),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(st.fixed_dictionaries({"text": junk}))}
    ),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.just([{"type": "image_url", "image_url": "x"}])}
    ),
)
response_format = F(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries({"schema": schema.valid}),
            }
        ),
    ),
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["xml", "json_schema"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.one_of(st.fixed_dictionaries({"schema": schema.edge}), junk),
            }
        ),
    ),
)
chat_body = body_of(
    ChatBody,
    {
        **OPENAI_SAMPLING,
        "messages": F(
            st.lists(message, min_size=1, max_size=4),
            st.one_of(
                st.just([]), st.lists(st.one_of(message, bad_message), min_size=1, max_size=3)
            ),
        ),
        "max_completion_tokens": some_tokens,
        "logprobs": flag,
        "top_logprobs": F(st.integers(0, 5), st.sampled_from([-1, 21])),
        "response_format": response_format,
    },
    required=("messages", "max_tokens"),
)
protocol_sampling = body_of(
    SamplingParams,
    {
        "max_new_tokens": few_tokens,
        "min_new_tokens": F(st.integers(0, 1), st.integers(9, 100)),
        "temperature": floats_in(0, 3),
        "top_k": F(st.integers(0, 50), st.just(-1)),
        "repetition_penalty": F(st.floats(0.1, 3), st.sampled_from([0, -1])),
        "stop": stops,
        "stop_token_ids": stop_ids,
        "stop_regex": stop_regexes,
        "ignore_eos": flag,
        "logprobs": flag,
        "top_logprobs": F(st.integers(0, 5), st.sampled_from([-1, 21])),
        "prompt_logprobs": flag,
        "logprob_start_len": F(st.integers(1, 20), st.sampled_from([0, -1, 10**9])),
        "include_stop_str_in_output": flag,
        "seed": F(st.integers(0, 2**32), st.sampled_from([2**64, -(2**64)])),
    },
    required=("max_new_tokens",),
)
constraint = F(
    st.one_of(
        st.fixed_dictionaries({"regex": regex.valid}),
        st.fixed_dictionaries({"json_schema": schema.valid}),
        st.fixed_dictionaries(
            {"choices": st.lists(plain_text.filter(bool), min_size=1, max_size=4)}
        ),
        st.fixed_dictionaries({"grammar": grammar.valid}),
    ),
    st.one_of(
        st.just({}),
        st.fixed_dictionaries({"regex": st.one_of(regex.edge, surrogate_text)}),
        st.fixed_dictionaries({"json_schema": schema.edge}),
        st.fixed_dictionaries(
            {"choices": st.one_of(st.just([]), st.lists(surrogate_text, min_size=1))}
        ),
        st.fixed_dictionaries({"grammar": grammar.edge}),
        st.fixed_dictionaries({"regex": regex.valid, "grammar": grammar.valid}),
    ),
)
flowlang_generate_body = body_of(
    GenerateRequest,
    {
        "rid": F(plain_text.filter(bool), surrogate_text),
        "text": prompt_text,
        "input_ids": token_ids,
        "sampling": F(protocol_sampling),
        "constraint": constraint,
        "hints": hints,
        "namespace": texts,
        "timeout_s": F(st.floats(0.5, 5), st.sampled_from([0, -1, 1e-9, 0.01, 1e308])),
    },
    required=("sampling",),
    exclusive=("text", "input_ids"),
    one_needed=True,
)
score_body = body_of(
    ScoreRequest,
    {
        "prefix": F(
            st.one_of(prompt_text.valid, token_ids.valid),
            st.one_of(prompt_text.edge, token_ids.edge),
        ),
        "continuations": F(
            st.lists(st.one_of(prompt_text.valid, token_ids.valid), min_size=1, max_size=4),
            st.one_of(
                st.just([]),
                st.lists(st.one_of(prompt_text.edge, token_ids.edge), min_size=1, max_size=2),
            ),
        ),
        "namespace": texts,
        "hints": hints,
    },
    required=("prefix", "continuations"),
)
pin_body = body_of(
    PinBody,
    {
        "prefix_ids": token_ids,
        "namespace": texts,
        "hints": hints,
        "lease_seconds": F(st.floats(0.1, 2), st.sampled_from([0, -1, 3601, float("inf")])),
    },
    required=("prefix_ids",),
)
tokenize_body = body_of(
    TokenizeBody, {"text": prompt_text, "add_special_tokens": flag}, required=("text",)
)
profile_body = st.one_of(st.none(), body_of(ProfileBody, {"num_steps": F(st.integers(0, 5))}))
concatenate_body = body_of(
    ConcatenateBody,
    {
        "src_rids": F(st.lists(plain_text, max_size=3), st.lists(surrogate_text, min_size=1)),
        "dst_rid": texts,
    },
    required=("src_rids", "dst_rid"),
)
pin_ids = st.one_of(
    plain_text, surrogate_text, st.sampled_from(["pin-000000000000", "..", "%2F", "a/b"])
)


def _quote(text: str) -> str:
    return urllib.parse.quote(text.encode("utf-8", "surrogatepass"), safe="")


ROUTES = st.one_of(  # (method, path, body); a body of None sends none
    st.tuples(st.sampled_from(["POST", "PUT"]), st.just("/generate"), generate_body),
    st.tuples(st.just("POST"), st.just("/v1/completions"), completion_body),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), chat_body),
    st.tuples(st.just("POST"), st.just("/v1/flowlang/generate"), flowlang_generate_body),
    st.tuples(st.just("POST"), st.just("/v1/flowlang/tokenize"), tokenize_body),
    st.tuples(st.just("POST"), st.just("/v1/flowlang/score"), score_body),
    st.tuples(st.just("POST"), st.just("/v1/flowlang/pin"), pin_body),
    st.tuples(
        st.just("POST"), pin_ids.map(lambda p: f"/v1/flowlang/pin/{_quote(p)}/renew"), st.none()
    ),
    st.tuples(st.just("DELETE"), pin_ids.map(lambda p: f"/v1/flowlang/pin/{_quote(p)}"), st.none()),
    st.tuples(st.sampled_from(["POST", "PUT"]), st.just("/encode"), st.one_of(junk, generate_body)),
    st.tuples(st.just("POST"), st.sampled_from(["/start_profile", "/stop_profile"]), profile_body),
    st.tuples(st.just("POST"), st.just("/concate_and_append_request"), concatenate_body),
    st.tuples(st.just("POST"), st.just("/flush_cache"), st.one_of(st.none(), junk)),
)
PATHS = [
    ("POST", "/generate"),
    ("PUT", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/flowlang/generate"),
    ("POST", "/v1/flowlang/tokenize"),
    ("POST", "/v1/flowlang/score"),
    ("POST", "/v1/flowlang/pin"),
    ("POST", "/v1/flowlang/pin/x/renew"),
    ("DELETE", "/v1/flowlang/pin/x"),
    ("POST", "/encode"),
    ("POST", "/start_profile"),
    ("POST", "/stop_profile"),
    ("POST", "/concate_and_append_request"),
    ("POST", "/flush_cache"),
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/v1/flowlang/info"),
    ("POST", "/no/such/route"),
]
FIELD_NAMES = sorted(
    {
        name
        for model in (GenerateBody, SGLangSamplingParams, ChatBody, CompletionBody, GenerateRequest)
        for name in model.model_fields
    }
)
arbitrary_json = st.one_of(  # with a fair chance of real field names as keys
    junk,
    st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), plain_text), hostile, max_size=6),
)
CONTENT_TYPES = st.sampled_from(
    [None, "application/json", "text/plain", "application/json; charset=utf-16",
     "multipart/form-data; boundary=x", "application/x-www-form-urlencoded", "\xff/json"]
)  # fmt: skip
AUTH = st.sampled_from(["user", "user", "user", "admin", "wrong", "none", "not-bearer"])


def _nested(depth: int, inner: str = "1") -> bytes:
    return ("[" * depth + inner + "]" * depth).encode()


def _not_json() -> st.SearchStrategy[bytes]:
    """Bodies that are not (valid, UTF-8) JSON, or push the parser's limits."""
    valid = json.dumps(CONTROL).encode()
    return st.one_of(
        st.binary(max_size=200),
        st.integers(1, len(valid) - 1).map(lambda n: valid[:n]),  # cut short
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b'"text"',
                b'{"text": "\xff\xfe"}',
                b'{"text": "caf\xe9"}',  # Latin-1
                b'\xef\xbb\xbf{"text": "hi", "sampling_params": {"max_new_tokens": 1}}',
                valid.decode().encode("utf-16"),
                valid.decode().encode("utf-32"),
                b'{"text": "a", "text": 1}',
                b'{"text": "hi"} trailing',
                b'{"text": "hi", "sampling_params": {"max_new_tokens": NaN}}',
                b'{"text": "hi", "sampling_params": {"max_new_tokens": 1e999}}',
                b'{"text": "hi", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}",
                b'{"input_ids": [' + b"1," * 50_000 + b"1]}",
                b'{"text": "\\ud800\\udc00\\udfff"}',
                _nested(5_000),
                _nested(200_000),
                b'{"text": ' + _nested(100_000, '"x"') + b"}",
                b'{"text": "' + b"a" * (MAX_BODY_BYTES + 10) + b'"}',
            ]
        ),
    )


# ---------------------------------------------------------------- sending and judging
# how the engine words its own failures (runtime/loop.py, runtime/engine.py): a 4xx or a 200
# stream that carries one of these is a server error under a client error's name
INTERNAL_FAILURES = ("engine step failed", "the forward pass failed")
REACHED = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/flowlang/generate",
           "/v1/flowlang/tokenize", "/v1/flowlang/score", "/v1/flowlang/pin")  # fmt: skip


def send(
    servers: Servers,
    name: str,
    method: str,
    path: str,
    body: Any,
    *,
    raw: bytes | None = None,
    auth: str = "user",
    content_type: str | None = "application/json",
) -> httpx.Response:
    """Send one request to server `name` and check the answer: no 5xx for what the client got
    wrong, within the deadline, no server failure under another name, and a stream that
    started ends with [DONE]."""
    headers: dict[str, Any] = {}
    if content_type is not None:
        headers["content-type"] = content_type.encode("latin-1")
    key = {"user": USER, "admin": ADMIN, "wrong": "nope"}.get(auth)
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    elif auth == "not-bearer":
        headers["authorization"] = b"Basic \xff\xfe=="
    if raw is not None:
        content = raw
    elif body is not None:
        content = json.dumps(body).encode()  # ASCII escapes: a lone surrogate travels as \ud800
    else:
        content = None
    shown = (content or b"")[:600]
    where = f"{name} {method} {path} auth={auth} content-type={content_type} body={shown!r}"
    where += "".join(f"\n  after: {before}" for before in servers.history)
    servers.history.append(f"{name} {method} {path} body={(content or b'')[:300]!r}")
    started = time.monotonic()
    try:
        response = servers[name].client.request(method, path, content=content, headers=headers)
    except httpx.HTTPError as err:  # a timeout, or a connection the server broke off
        pytest.fail(f"{err!r} after {time.monotonic() - started:.1f} s: {where}")
    elapsed = time.monotonic() - started
    status = response.status_code
    servers.history[-1] += f" -> {status} in {elapsed:.2f} s"
    servers.outcomes[path if path in REACHED else "other", status] += 1
    assert elapsed < DEADLINE_S, f"answered after {elapsed:.1f} s: {where}"
    busy = status == 503 and "retry-after" in response.headers
    assert status < 500 or busy, f"{status} {response.text[:600]}: {where}"
    internal = next((m for m in INTERNAL_FAILURES if m in response.text), None)
    assert internal is None, (
        f"a server failure reported as {status}: {response.text[:600]}: {where}"
    )
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), f"a stream without [DONE]: {where}"
    return response


# ---------------------------------------------------------------- the fuzzing
SERVER = st.sampled_from(["open", "keyed"])
PIN_STEPS = st.lists(
    st.sampled_from(["renew", "release", "other-renew", "other-release"]), max_size=3
)


@pytest.mark.parametrize(
    "num_examples", [1000, pytest.param(4000, marks=pytest.mark.slow, id="long")]
)
def test_route_bodies_with_hostile_values(fresh, num_examples):
    @settings(FUZZ, max_examples=num_examples)
    @given(name=SERVER, route=ROUTES, auth=AUTH, steps=PIN_STEPS)
    def fuzz(name, route, auth, steps):
        method, path, body = route
        response = send(fresh, name, method, path, body, auth=auth)
        if path == "/v1/flowlang/pin" and response.status_code == 200:
            # a held pin: renew it, release it (twice), or touch it as another tenant
            pin = f"/v1/flowlang/pin/{response.json()['pin_id']}"
            for step in steps:
                who = ("admin" if auth == "user" else "user") if step.startswith("other") else auth
                if step.endswith("renew"):
                    send(fresh, name, "POST", f"{pin}/renew", None, auth=who)
                else:
                    send(fresh, name, "DELETE", pin, None, auth=who)

    fuzz()
    print("outcomes (route, status):", sorted(fresh.outcomes.items()))
    missing = [path for path in REACHED if fresh.outcomes[path, 200] == 0]
    assert not missing, f"no valid request reached the engine on {missing}"
    assert_intact(fresh)


def test_arbitrary_json_anywhere(fresh):
    @settings(FUZZ, max_examples=3000)
    @given(
        name=SERVER,
        route=st.sampled_from(PATHS),
        body=arbitrary_json,
        content_type=CONTENT_TYPES,
        auth=AUTH,
    )
    def fuzz(name, route, body, content_type, auth):
        method, path = route
        send(fresh, name, method, path, body, auth=auth, content_type=content_type)

    fuzz()
    assert_intact(fresh)


def test_bodies_that_are_not_json(fresh):
    @settings(FUZZ, max_examples=800)
    @given(
        name=SERVER, route=st.sampled_from(PATHS[:15]), raw=_not_json(), content_type=CONTENT_TYPES
    )
    def fuzz(name, route, raw, content_type):
        method, path = route
        send(fresh, name, method, path, None, raw=raw, content_type=content_type)

    fuzz()
    assert_intact(fresh)


# ---------------------------------------------------------------- found by fuzzing, kept
SURROGATE = "\ud800"
OUTLIVED = {"max_new_tokens": 8, "ignore_eos": True, "regex": "(yes|no)"}  # EOS, then more
REGRESSIONS = [
    # a lone surrogate echoed into a JSON response cannot be encoded: 500
    ("POST", "/concate_and_append_request", {"src_rids": [SURROGATE], "dst_rid": "x"}),
    (
        "POST",
        "/generate",
        {"text": "hi", "rid": SURROGATE, "sampling_params": {"max_new_tokens": 2}},
    ),
    (
        "POST",
        "/generate",
        {"text": "hi", "rid": [SURROGATE], "sampling_params": {"max_new_tokens": 2}},
    ),
    ("POST", "/v1/flowlang/pin", {"prefix_ids": [1, 2], "namespace": SURROGATE}),
    # a lone surrogate in a constraint fails its cache key (model_dump_json): 500
    (
        "POST",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "regex": SURROGATE}},
    ),
    (
        "POST",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "ebnf": f'root ::= "{SURROGATE}"'}},
    ),
    (
        "POST",
        "/v1/flowlang/generate",
        {"text": "hi", "constraint": {"choices": [SURROGATE]}, "sampling": {"max_new_tokens": 2}},
    ),
    (
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"enum": [SURROGATE]}},
            },
        },
    ),
    # a constrained request asked to go on past its grammar's end (ignore_eos, min_new_tokens):
    # jump-forward on a terminated matcher raises in the step, which fails every running request
    ("POST", "/generate", {"text": "hi", "sampling_params": OUTLIVED}),
    ("POST", "/generate", {"text": "hi", "sampling_params": OUTLIVED, "stream": True}),
    (
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "min_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["a"]}}},
        },
    ),
]


@pytest.mark.parametrize(("method", "path", "body"), REGRESSIONS)
def test_regressions_found_by_fuzzing(shared, method, path, body):
    for name in shared.by_name:
        send(shared, name, method, path, body)


def test_a_constrained_request_past_its_grammar_fails_alone(shared):
    """Another client's request, running when the bad one breaks, still gets its answer."""
    server = shared["open"]
    victim: dict[str, Any] = {}
    long_one = {
        "text": "A bystander",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }

    def bystander() -> None:
        with httpx.Client(base_url=server.thread.url, timeout=DEADLINE_S * 2) as other:
            victim["response"] = other.post("/generate", json=long_one)

    thread = threading.Thread(target=bystander)
    thread.start()
    assert wait_for(lambda: server.engine.stats()["num_running"] >= 1, timeout=10)
    response = server.client.post("/generate", json={"text": "hi", "sampling_params": OUTLIVED})
    thread.join(DEADLINE_S * 2)
    assert victim["response"].status_code == 200, (response.text, victim["response"].text)


def test_scoring_when_pins_hold_the_pool_is_busy_not_a_server_error(shared):
    """A score that cannot fit while pins hold the pool is a 503 with Retry-After, as /generate
    says for the same prompt, not a 500."""
    pinned = send(
        shared, "open", "POST", "/v1/flowlang/pin", {"prefix_ids": [7] * 3_990, "lease_seconds": 60}
    )
    assert pinned.status_code == 200, pinned.text
    try:
        generated = send(
            shared,
            "open",
            "POST",
            "/generate",
            {"input_ids": [9] * 4_500, "sampling_params": {"max_new_tokens": 1}},
        )
        scored = send(
            shared,
            "open",
            "POST",
            "/v1/flowlang/score",
            {"prefix": [9] * 4_500, "continuations": [[1]]},
        )
        assert generated.status_code == scored.status_code == 503, (generated.text, scored.text)
    finally:
        shared["open"].client.delete(f"/v1/flowlang/pin/{pinned.json()['pin_id']}")


def test_scoring_continuations_that_share_a_long_prefix_takes_few_steps(shared):
    """Two continuations sharing 1,000 tokens: today one pin and one engine step per shared
    token (with 7,900 shared tokens: minutes, thousands of pins, past any deadline, and not
    aborted when the client leaves). The shared part should be computed in a few steps."""
    server = shared["open"]
    before = server.engine.stats()["steps_total"]
    body = {"prefix": "Hello", "continuations": [[45] * 1_000 + [1], [45] * 1_000 + [2]]}
    assert send(shared, "open", "POST", "/v1/flowlang/score", body).status_code == 200
    steps = server.engine.stats()["steps_total"] - before
    assert steps <= 64, f"{steps} engine steps to score two continuations"
    assert wait_for(lambda: server.engine.stats()["num_pins"] == 0)


def test_after_the_explicit_cases_the_engines_are_intact(shared):
    assert_intact(shared)
