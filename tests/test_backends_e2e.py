"""The same programs end to end through the in-process backend and through HTTP
(`RemoteBackend` against `flowlang serve`): identical results, pins released."""

from __future__ import annotations

import pytest

import flowlang as fl
from flowlang.backends.local import LocalBackend
from flowlang.backends.remote import RemoteBackend
from programs import judge, support_agent

RESULTS: dict[str, dict] = {}


@fl.program
def pick(s, question):
    s += fl.user(question)
    with s.assistant():
        s += "Answer:"
        s += fl.select("choice", choices=[" Paris", " London", " a city"])
        s += fl.gen("more", max_new_tokens=6, temperature=0)
    s += fl.user("Again, as JSON.")
    s += fl.assistant(
        fl.gen(
            "data",
            schema={
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
            },
            max_new_tokens=20,
            temperature=0,
        )
    )


@pytest.fixture(params=["local", "remote"])
def backend(request, served):
    if request.param == "local":
        yield request.param, LocalBackend(served.engine)
    else:
        remote = RemoteBackend(served.url)
        yield request.param, remote
        remote.close()


def run_all(backend) -> dict:
    tokenizer = backend.engine.tokenizer if isinstance(backend, LocalBackend) else None
    from runtime.model.loader import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(backend.info["model"])
    w1 = support_agent.make_inputs(tokenizer, "test")
    states = support_agent.support_agent.run_batch(
        support_agent.batch_args(w1)[:4], backend=backend, progress=False
    )
    case = judge.make_inputs(tokenizer, "test")[0]
    judged = judge.judge.run(case=case, backend=backend)
    picked = pick.run("What is the capital of France?", backend=backend)
    return {
        "w1": [s.variables() for s in states],
        "judge": judged.variables(),
        "judge_text": judged.text(),
        "pick": picked.variables(),
    }


def test_same_results_locally_and_over_http(backend, served):
    name, impl = backend
    RESULTS[name] = run_all(impl)
    assert served.engine.stats()["num_pins"] == 0
    assert all(isinstance(v, dict) for v in RESULTS[name]["w1"])
    if len(RESULTS) == 2:
        assert RESULTS["local"] == RESULTS["remote"]
