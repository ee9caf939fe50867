"""Agent hints from clients that are not flowlang programs (runtime/server/agent_hints.py): each
HTTP form (Dynamo's nvext.agent_hints and agent_context and its session headers, SGLang's
session_id and priority, flowlang's hints) reaches the engine as the GraphHints a program would
send, the ones this server cannot honour are a 400 naming them, sources that disagree are a 400
naming both, and session ids are per API key."""

from __future__ import annotations

import logging

import httpx
import pytest
from conftest import ServerThread, recording_server
from openai import OpenAI
from pydantic import ValidationError

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import MAX_HINT_FUTURE_TOKENS, GraphHints

A, B = "key-a", "key-b"
CHAT = {"messages": [{"role": "user", "content": "Read the file."}], "max_tokens": 1}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": 1}
GENERATE = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 1}}
BODIES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/generate": GENERATE}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A two-tenant tiny-model server that records the engine requests each call submits."""
    thread = recording_server(
        Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=4096)), api_keys=(A, B)
    )
    yield thread
    thread.stop()


def tag(server: ServerThread, key: str = A) -> str:
    return server.app.state.server.keys[key]


def send(
    server: ServerThread,
    extra: dict,
    headers: dict | None = None,
    route: str = "/v1/chat/completions",
    key: str = A,
) -> tuple[httpx.Response, list[GraphHints]]:
    """POST `route`'s sample body with `extra` and `headers` as API key `key`; the answer and
    the hints of the engine requests it submitted."""
    server.submitted.clear()
    auth = {"Authorization": f"Bearer {key}", **(headers or {})}
    response = httpx.post(
        server.url + route, json={**BODIES[route], **extra}, headers=auth, timeout=120
    )
    return response, [r.hints for r in (server.submitted[0] if server.submitted else [])]


def mapped(server: ServerThread, extra: dict, headers: dict | None = None, **kw) -> GraphHints:
    response, hints = send(server, extra, headers, **kw)
    assert response.status_code == 200, response.text
    assert hints and all(h == hints[0] for h in hints)
    return hints[0]


# ---------------------------------------------------------------- accepted and mapped
def test_each_session_form_names_the_program_under_the_callers_key(server):
    program = f"{tag(server)}/run-42"
    assert mapped(server, {}, {"X-Dynamo-Session-ID": "run-42"}).program_id == program
    assert mapped(server, {}, {"X-Session-ID": "run-42"}).program_id == program
    assert mapped(server, {"session_id": "run-42"}).program_id == program
    context = {"session_id": "run-42", "trajectory_id": "run-42:reader"}
    hints = mapped(server, {"nvext": {"agent_context": context}})
    assert (hints.program_id, hints.branch_id) == (program, "run-42:reader")
    assert mapped(server, {"hints": {"program_id": "run-42"}}).program_id == program
    assert mapped(server, {}).program_id is None  # no session: no program


def test_a_parent_session_is_the_subagents_fork_group(server):
    group = f"{tag(server)}/planner"
    hints = mapped(
        server, {}, {"X-Dynamo-Session-ID": "a", "X-Dynamo-Parent-Session-ID": "planner"}
    )
    assert hints.fork_group_id == group
    assert mapped(server, {}, {"X-Parent-Session-ID": "planner"}).fork_group_id == group
    context = {"session_id": "a", "trajectory_id": "b", "parent_trajectory_id": "planner"}
    assert mapped(server, {"nvext": {"agent_context": context}}).fork_group_id == group


def test_each_priority_form_sets_the_priority(server):
    assert mapped(server, {"priority": 3}).priority == 3
    assert mapped(server, {"nvext": {"agent_hints": {"priority": 5}}}).priority == 5
    assert mapped(server, {}, {"X-Dynamo-Request-Priority": "7"}).priority == 7
    assert mapped(server, {"hints": {"priority": -2}}).priority == -2
    both = {"priority": 5, "nvext": {"agent_hints": {"priority": 5}}}
    assert mapped(server, both).priority == 5  # sources that agree are one claim
    assert mapped(server, {}).priority == 0


def test_osl_and_speculative_prefill(server):
    hints = mapped(server, {"nvext": {"agent_hints": {"osl": 1024, "speculative_prefill": True}}})
    assert hints.expected_output_tokens == 1024 and hints.continuation
    hints = mapped(server, {"nvext": {"agent_hints": {"speculative_prefill": False}}})
    assert not hints.continuation
    final = mapped(server, {}, {"X-Dynamo-Session-Final": "true"})
    assert not final.continuation
    # strict_priority 0 is Dynamo's default tier: unset
    assert mapped(server, {"nvext": {"agent_hints": {"strict_priority": 0}}}).priority == 0


def test_flowlang_hints_pass_through_with_ids_under_the_callers_key(server):
    sent = {
        "program_id": "p",
        "branch_id": "main",
        "fork_group_id": "g",
        "fork_group_size": 3,
        "continuation": True,
        "next_turn_after_s": 2.5,
        "waits_on_tools": True,
        "future_tokens": 300,
        "expected_output_tokens": 40,
    }
    hints = mapped(server, {"hints": sent})
    qualified = {"program_id": f"{tag(server)}/p", "fork_group_id": f"{tag(server)}/g"}
    assert hints == GraphHints(**{**sent, **qualified})


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
def test_the_other_routes_map_the_same(server, route):
    hints = mapped(
        server,
        {"session_id": "s", "priority": 4, "hints": {"continuation": True}},
        {"X-Dynamo-Parent-Session-ID": "up"},
        route=route,
    )
    assert hints == GraphHints(
        program_id=f"{tag(server)}/s", fork_group_id=f"{tag(server)}/up", priority=4,
        continuation=True,
    )  # fmt: skip
    if route == "/v1/completions":
        nvext = {"nvext": {"agent_hints": {"osl": 9}}}
        assert mapped(server, nvext, route=route).expected_output_tokens == 9


def test_a_batch_is_one_programs_requests(server):
    hints = mapped(
        server, {"text": ["a", "b"], "session_id": "s"}, {"X-Session-ID": "s"}, route="/generate"
    )
    assert hints.program_id == f"{tag(server)}/s"


def test_two_tenants_with_one_session_id_are_two_programs(server):
    a = mapped(server, {}, {"X-Dynamo-Session-ID": "shared"}, key=A)
    b = mapped(server, {}, {"X-Dynamo-Session-ID": "shared"}, key=B)
    assert a.program_id != b.program_id
    assert {a.program_id, b.program_id} == {f"{tag(server, A)}/shared", f"{tag(server, B)}/shared"}
    b_group = mapped(server, {"hints": {"fork_group_id": "g"}}, route="/generate", key=B)
    assert b_group.fork_group_id == f"{tag(server, B)}/g"


def test_the_flowlang_route_puts_ids_under_the_callers_key(server):
    body = {"text": "Hi", "sampling": {"max_new_tokens": 1}, "hints": {"program_id": "p"}}
    server.submitted.clear()
    auth = {"Authorization": f"Bearer {B}"}
    with httpx.stream(
        "POST", server.url + "/v1/flowlang/generate", json=body, headers=auth, timeout=120
    ) as response:
        assert response.status_code == 200
        response.read()
    (request,) = server.submitted[0]
    assert request.hints.program_id == f"{tag(server, B)}/p"


def test_the_openai_client_sends_them_in_extra_body_and_headers(server):
    client = OpenAI(base_url=server.url + "/v1", api_key=A)
    server.submitted.clear()
    nvext = {
        "agent_hints": {"priority": 5, "osl": 64, "speculative_prefill": True},
        "agent_context": {"session_id": "run-7", "trajectory_id": "run-7:main"},
    }
    client.chat.completions.create(
        model=server.engine.config.model,
        messages=CHAT["messages"],
        max_tokens=1,
        extra_headers={"X-Dynamo-Parent-Session-ID": "root"},
        extra_body={"nvext": nvext},
    )
    client.completions.create(
        model=server.engine.config.model,
        prompt="Once",
        max_tokens=1,
        extra_body={"session_id": "run-7", "priority": 5},
    )
    chat, completion = (requests[0].hints for requests in server.submitted)
    assert chat == GraphHints(
        program_id=f"{tag(server)}/run-7", branch_id="run-7:main",
        fork_group_id=f"{tag(server)}/root", priority=5, continuation=True,
        expected_output_tokens=64,
    )  # fmt: skip
    assert completion == GraphHints(program_id=f"{tag(server)}/run-7", priority=5)


def test_session_type_is_logged_as_having_no_effect(server, caplog):
    context = {"session_type_id": "deep_research", "session_id": "r"}
    with caplog.at_level(logging.WARNING, logger="flowlang.server"):
        mapped(server, {"nvext": {"agent_context": context}})
    assert "nvext.agent_context.session_type_id" in caplog.text


# ---------------------------------------------------------------- refused by name
def nv(**hints) -> dict:
    return {"nvext": {"agent_hints": hints}}


def ctx(**context) -> dict:
    return {"nvext": {"agent_context": context}}


FINAL, STRICT = "X-Dynamo-Session-Final", "X-Dynamo-Request-Strict-Priority"


@pytest.mark.parametrize(
    "extra, headers, named",
    [
        (nv(strict_priority=1), {}, ["nvext.agent_hints.strict_priority"]),
        ({}, {STRICT: "2"}, [STRICT.lower()]),
        ({"nvext": {"annotations": ["x"]}}, {}, ["nvext.annotations"]),
        (nv(latency_sensitivity=1), {}, ["nvext.agent_hints.latency_sensitivity"]),
        (ctx(tool="ls"), {}, ["nvext.agent_context.tool"]),
        (nv(osl=-1), {}, ["nvext.agent_hints.osl"]),
        (nv(priority="high"), {}, ["nvext.agent_hints.priority"]),
        ({}, {"X-Dynamo-Request-Priority": "high"}, ["x-dynamo-request-priority"]),
        ({}, {FINAL: "maybe"}, [FINAL.lower()]),
        ({"session_params": {"id": "s"}}, {}, ["session_params"]),
        ({"session_id": "x" * 1024}, {}, ["session_id: at most"]),
        # one input, two values: both named
        ({"priority": 1, **nv(priority=5)}, {}, ["priority=1", "nvext.agent_hints.priority=5"]),
        ({"session_id": "a"}, {"X-Dynamo-Session-ID": "b"}, ["session_id='a'", "-session-id='b'"]),
        (ctx(session_id="a"), {"X-Session-ID": "b"}, ["context.session_id='a'", "x-session-id"]),
        (nv(speculative_prefill=True), {FINAL: "true"}, ["speculative_prefill", FINAL.lower()]),
        (
            {"hints": {"continuation": False}, **nv(speculative_prefill=True)},
            {},
            ["hints.continuation=False", "speculative_prefill=True"],
        ),
        (
            {"hints": {"expected_output_tokens": 9}, **nv(osl=8)},
            {},
            ["osl=8", "hints.expected_output_tokens=9"],
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(server, extra, headers, named):
    response, hints = send(server, extra, headers)
    assert response.status_code == 400, response.text
    assert not hints  # nothing reached the engine
    message = response.json()["error"]["message"]
    assert all(name in message for name in named), message


@pytest.mark.parametrize(
    "route, extra, named",
    [
        ("/v1/chat/completions", {"hints": {"program": "p"}}, "program"),
        ("/generate", {"hints": {"program": "p"}}, "program"),
        ("/generate", {"hints": {"waits_on_tools": True}}, "waits_on_tools needs continuation"),
        ("/generate", {"nvext": {"agent_hints": {"priority": 1}}}, "nvext"),  # Dynamo's OpenAI only
    ],
)
def test_unknown_fields_are_a_422_naming_them(server, route, extra, named):
    response, hints = send(server, extra, route=route)
    assert response.status_code == 422 and named in response.text and not hints


def test_expected_output_tokens_is_bounded_like_future_tokens():
    assert GraphHints(expected_output_tokens=MAX_HINT_FUTURE_TOKENS).expected_output_tokens
    for bad in (-1, MAX_HINT_FUTURE_TOKENS + 1):
        with pytest.raises(ValidationError):
            GraphHints(expected_output_tokens=bad)
