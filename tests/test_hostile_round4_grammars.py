"""Hostile testing, fourth round (issue 50), grammars: a tool grammar compiles as every other
constraint does (a trial in the child, kept when small, else compiled again on the compile
queue's low-priority thread, never anywhere else) (#6); every constraint kind, tool parameters
and earlier calls' arguments are held to one nesting limit (#12); the endless-grammar check
covers every tool grammar (#13); each tenant has a grammar cache of its own (#14)."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from conftest import ServerThread

from runtime.config import EngineConfig
from runtime.constrain import grammar as constrained
from runtime.constrain.check import endless_rules
from runtime.constrain.grammar import GrammarCache, InvalidConstraintError, check_nesting
from runtime.engine import Engine
from runtime.protocol import Constraint, GenerateRequest, SamplingParams

KEYS = ("key-a", "key-b")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=8192))
    thread = ServerThread(engine, api_keys=KEYS)
    yield thread
    thread.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=120, headers=auth(KEYS[0])) as client:
        yield client


def tool_chat(parameters: dict, choice: object = "auto", **extra: object) -> dict:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    messages = [{"role": "user", "content": "call f"}]
    return {"messages": messages, "tools": [tool], "tool_choice": choice, "max_tokens": 4, **extra}


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---------------------------------------------------------------- #6 where tool grammars compile
@pytest.fixture
def compiles(server, monkeypatch):
    """(thread name, its nice value) of each trial and of each compile in the server's process."""
    grammars = server.engine.intake.grammars
    trials, here = [], []

    def where() -> tuple[str, int]:
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    original_trial, original_compile = grammars.probe.trial, constrained.compile_constraint

    def trial(constraint, budget_s):
        trials.append(where())
        return original_trial(constraint, budget_s)

    def compile_here(compiler, constraint):
        here.append(where())
        return original_compile(compiler, constraint)

    monkeypatch.setattr(grammars.probe, "trial", trial)
    monkeypatch.setattr(constrained, "compile_constraint", compile_here)
    return trials, here


def test_a_tool_grammar_is_the_trials_grammar_never_compiled_again_in_the_server(client, compiles):
    trials, here = compiles
    parameters = {"type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]{3}q"}}}
    response = client.post("/v1/chat/completions", json=tool_chat(parameters))
    assert response.status_code == 200, response.text
    assert [name for name, _ in trials] == ["grammar-compiles"]
    assert here == [], "the trial's grammar is kept: nothing compiles in the server's process"


def test_a_large_grammar_compiled_again_runs_on_the_low_priority_compile_thread(
    server, client, compiles, monkeypatch
):
    trials, here = compiles
    probe = server.engine.intake.grammars.probe
    kept = probe.trial  # the recording wrapper

    def nothing_sent(constraint, budget_s):  # as for a grammar too large to send back
        verdict = kept(constraint, budget_s)
        return constrained.ProbeVerdict(verdict.outcome, verdict.detail, verdict.num_bytes)

    monkeypatch.setattr(probe, "trial", nothing_sent)
    parameters = {"type": "object", "properties": {"y": {"type": "string", "pattern": "[a-z]{4}w"}}}
    response = client.post("/v1/chat/completions", json=tool_chat(parameters))
    assert response.status_code == 200, response.text
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert [name for name, _ in here] == ["grammar-compiles"]
    assert here[0][1] > base_nice, "the compile thread runs at a lower priority"


# ---------------------------------------------------------------- #12 nesting limits
@pytest.mark.parametrize("depth", [40, 140])
def test_tool_parameters_nested_past_the_limit_are_a_400_naming_it(client, depth):
    response = client.post("/v1/chat/completions", json=tool_chat(nested_objects(depth)))
    assert response.status_code == 400, response.text
    assert "nest deeper than 64 levels" in response.text


def test_history_arguments_nested_past_the_limit_are_a_400_naming_it(client):
    for depth in (100, 3000):
        arguments = '{"a": ' + "[" * depth + "]" * depth + "}"
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        body = {**tool_chat({"type": "object"}), "messages": messages}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert "nest deeper than 64 levels" in response.text


def test_a_structural_tag_nested_past_the_limit_is_refused_before_anything_recurses():
    content: dict = {"type": "string"}
    for _ in range(200):
        content = {"type": "array", "items": content}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": content}}
    with pytest.raises(InvalidConstraintError, match="nests deeper than"):
        check_nesting(Constraint(structural_tag=tag))


# ---------------------------------------------------------------- #13 endless tool grammars
SELF_REQUIRED = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}


NAMED = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize("choice", ["auto", "required", NAMED])
def test_a_tool_that_requires_itself_is_refused_under_every_choice(client, choice):
    response = client.post("/v1/chat/completions", json=tool_chat(SELF_REQUIRED, choice))
    assert response.status_code == 400, response.text
    assert "can never end" in response.text


def test_the_check_reads_a_tag_dispatch_and_regex_patterns():
    grammar = (
        'root_0 ::= (("{" root_prop_0 "}"))\n'
        "root_prop_0 ::= ((root_0))\n"
        'group ::= (("<call>" root_0 "</call>"))\n'
        'text ::= Regex("a{2,5}", json_string=true)\n'
        'counted ::= (("x"){1, 3})\n'
        "dispatch ::= TagDispatch(\n"
        '  ("<call>", group),\n'
        "  loop_after_dispatch=true,\n"
        "  excludes=()\n"
        ")\n"
        "root ::= ((dispatch))\n"
    )
    assert endless_rules(grammar) == ["root_0", "root_prop_0", "group"]


# ---------------------------------------------------------------- #14 a cache per tenant
def test_a_constraint_another_tenant_compiled_is_compiled_again(server):
    intake = server.engine.intake
    request = GenerateRequest(
        rid="tenant-cache",
        text="x",
        constraint=Constraint(regex="[a-z]{5}per-tenant"),
        sampling=SamplingParams(max_new_tokens=1),
    )
    for future in intake.compile_ahead([request], "tenant-a"):
        future.result(60)
    assert intake.compile_ahead([request], "tenant-a") == []  # its own: cached
    futures = intake.compile_ahead([request], "tenant-b")  # another's: compiled again
    assert len(futures) == 1, "another tenant's compile must not find tenant-a's grammar"
    futures[0].result(60)
    assert intake.compile_ahead([request], "tenant-b") == []


def test_each_tenants_cache_is_bounded_and_evicts_only_its_own(default_tokenizer, monkeypatch):
    grammars = GrammarCache(default_tokenizer, 49152, (2,))
    try:
        monkeypatch.setattr(constrained, "MAX_CACHED_GRAMMARS", 2)
        other = Constraint(regex="[a-z]{2}b")
        grammars.compile(other, "b")
        mine = [Constraint(regex=f"[a-z]{{{n}}}a") for n in (2, 3, 4)]
        for constraint in mine:
            grammars.compile(constraint, "a")
        key = constrained.constraint_key
        assert [grammars.is_compiled(key(c), "a") for c in mine] == [False, True, True]
        assert grammars.is_compiled(key(other), "b")
        assert not grammars.is_compiled(key(other), None)  # in process: a cache of its own
    finally:
        grammars.probe.close()
