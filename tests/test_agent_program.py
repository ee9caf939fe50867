"""programs/agent.py: its tools on their own, then the agent on the default model end to end,
greedy, with the same outputs in-process, over flowlang's HTTP protocol and over SGLang's
native /generate (the SGLang-compatible path: structural tags as SGLang's sampling param)."""

from __future__ import annotations

from datetime import UTC, datetime

import jsonschema
import pytest
from conftest import ServerThread

import flowlang as fl
from programs import agent

NOW = datetime(2025, 3, 4, 5, 6, tzinfo=UTC)
TOOLS = agent.make_tools(now=lambda: NOW)
TASKS = agent.TASKS[:3]  # arithmetic, the documents, the time
OPTIONS = {"max_steps": 2, "max_new_tokens": 96, "tools": TOOLS}


def by_name(name: str) -> fl.Tool:
    return next(t for t in TOOLS if t.name == name)


def test_the_calculator_walks_the_tree_and_never_evals():
    assert agent.evaluate("17 * 23") == 391
    assert agent.evaluate("(125 + 75) / 8") == 25.0
    assert agent.evaluate("2 ^ 10 - 24") == 1000
    assert agent.evaluate("sqrt(144) + 8") == 20.0
    for bad in ("__import__('os').system('true')", "open('x')", "2 ** 1000", "a + 1", "1 +"):
        with pytest.raises(ValueError):
            agent.evaluate(bad)
    assert by_name("calculator").call({"expression": "-(3 - 5) * 2"}).run() == 4


def test_search_scores_keywords_and_the_clock_is_injectable():
    (first, *_) = agent.search("return policy")
    assert first["id"] == "returns"
    assert [d["id"] for d in agent.search("shipping", top_k=2)] == ["shipping", "express"]
    assert agent.search("zebra") == []
    clock = by_name("clock")
    assert clock.call({"timezone": "Asia/Tokyo"}).run() == "2025-03-04T14:06+09:00"
    assert clock.call({}).run() == "2025-03-04T05:06+00:00"
    with pytest.raises(ValueError, match="unknown timezone"):
        clock.call({"timezone": "Mars/Olympus"}).run()
    assert len(agent.TASKS) == 12 and len(agent.DOCUMENTS) == 12


def test_the_tools_declare_schemas_and_latencies():
    for made in agent.TOOLS:
        jsonschema.Draft202012Validator.check_schema(made.parameters)
        assert made.description and made.latency_s == agent.LATENCY_S[made.name]
    search = by_name("search_documents")
    assert search.parameters["required"] == ["query"]
    assert search.parameters["properties"]["top_k"] == {
        "default": 2,
        "maximum": 5,
        "minimum": 1,
        "type": "integer",
    }


@pytest.fixture(scope="module")
def served(default_model_path):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    thread = ServerThread(
        Engine(EngineConfig(model=str(default_model_path), max_kv_tokens=30_000)),
        pin_lease_seconds=30.0,
    )
    yield thread
    thread.stop()
    thread.engine.close()


def run_agents(backend) -> list[dict]:
    states = agent.agent.run_batch(
        agent.batch_args(TASKS, **OPTIONS), backend=backend, progress=False
    )
    failed = [s for s in states if isinstance(s, fl.InstanceError)]
    assert not failed, failed[0]
    return [
        {
            # a failed call's exception compares by identity: compare what the model read
            "steps": [
                [(n, a, repr(r) if isinstance(r, Exception) else r) for n, a, r in step]
                for step in s["steps"]
            ],
            "answer": s["answer"],
            "text": s.text(),
        }
        for s in states
    ]


def test_the_agent_end_to_end_locally_over_http_and_over_sglangs_api(served):
    import flowlang.sglang as sgl
    from flowlang.backends.local import LocalBackend

    engine = served.engine
    local = LocalBackend(engine, record=True)
    before = engine.stats()["prefill_tokens_total"]
    results = {"local": run_agents(local)}
    computed = engine.stats()["prefill_tokens_total"] - before
    # token stability: each step's prompt extends the previous step's prompt and output ids
    # exactly (the calls stay as decoded), so the next round reuses the KV decoding computed
    requests = [(r, h.result()) for r, h in local.generations]
    for request, result in requests:
        later = [
            r
            for r, _ in requests
            if r.hints.program_id == request.hints.program_id
            and len(r.input_ids) > len(request.input_ids)
        ]
        if later:
            held = request.input_ids + result.output_ids
            assert later[0].input_ids[: len(held)] == held
    # prefill once: the lower bound, but for 2 tokens per generation that max_new_tokens cut
    # inside a jump-forward span (an engine matter, reported to its owner)
    assert 0 <= computed - local.prompt_report()["lower_bound"] <= 2 * len(TASKS)
    for first in results["local"]:
        assert first["steps"], "the first round must call a tool (tool_choice required)"
        for name, arguments, _ in first["steps"][0]:
            jsonschema.validate(arguments, by_name(name).parameters)
    hints = [request.hints for request, _ in local.generations]
    assert all(h.continuation for h in hints[: len(TASKS)])  # each first step awaits its tools
    arithmetic = results["local"][0]["steps"][0]
    assert arithmetic[0][0] == "calculator"

    remote = sgl.RuntimeEndpoint(served.url)  # flowlang's protocol: RemoteBackend
    plain = sgl.RuntimeEndpoint(served.url, api="sglang")  # SGLang's /generate only
    try:
        assert remote.tool_format == plain.tool_format == local.tool_format
        results["remote"] = run_agents(remote)
        results["sglang"] = run_agents(plain)
    finally:
        remote.close()
        plain.close()
    assert results["remote"] == results["local"]
    assert results["sglang"] == results["local"]
    assert engine.stats()["num_pins"] == 0
