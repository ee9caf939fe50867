"""One bad request fails alone: poisoned sampling rows, a forward pass that breaks on one
request, bad ids, endless schemas, failing commands. The others' greedy outputs stay the same
as in a clean run, and the engine keeps serving."""

from __future__ import annotations

import time

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.model.runner import ModelRunner
from runtime.protocol import Constraint, GenerateRequest, SamplingParams, ScoreRequest

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4 + i] for i in range(4)]
POISON_TOKEN = 4242


def engine(tiny_model_dir, **kwargs) -> Engine:
    kwargs.setdefault("max_kv_tokens", 4000)
    return Engine(EngineConfig(model=str(tiny_model_dir), **kwargs))


def valid_requests() -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=p, sampling=GREEDY) for p in PROMPTS]


@pytest.fixture(scope="module")
def clean_outputs(tiny_model_dir):
    with engine(tiny_model_dir) as eng:
        return [r.output_ids for r in eng.generate(valid_requests())]


def test_poisoned_sampling_rows_fail_alone(tiny_model_dir, clean_outputs):
    poisoned = [
        SamplingParams(temperature=1.0, repetition_penalty=1e-40, max_new_tokens=8),
        SamplingParams(temperature=1.0, top_k=0, top_p=1e-300, min_p=1.0, max_new_tokens=8),
    ]
    with engine(tiny_model_dir) as eng:
        requests = valid_requests()
        requests[1:1] = [GenerateRequest(input_ids=[5, 6, 7], sampling=p) for p in poisoned]
        results = eng.generate(requests)
        outputs = [r.output_ids for i, r in enumerate(results) if i not in (1, 2)]
        assert outputs == clean_outputs
        assert "no valid distribution" in results[1].error  # +inf logits: NaN probabilities
        assert results[2].finish_reason == "length"  # extreme but valid: the top token only
        assert eng.stats()["num_running"] == 0
        eng.check_integrity()


def test_a_temperature_too_small_to_divide_by_is_greedy(tiny_model_dir, clean_outputs):
    tiny = SamplingParams(temperature=1e-45, max_new_tokens=8, ignore_eos=True)
    with engine(tiny_model_dir) as eng:
        result = eng.generate(GenerateRequest(input_ids=PROMPTS[0], sampling=tiny))[0]
    assert result.output_ids == clean_outputs[0]


def test_a_forward_pass_that_breaks_on_one_request_fails_only_that_one(
    tiny_model_dir, clean_outputs, monkeypatch
):
    real_forward = ModelRunner.forward

    def forward(self, batch):
        if POISON_TOKEN in batch.input_ids.tolist():
            raise RuntimeError("poisoned batch")
        return real_forward(self, batch)

    monkeypatch.setattr(ModelRunner, "forward", forward)
    with engine(tiny_model_dir) as eng:
        requests = valid_requests()
        requests.insert(2, GenerateRequest(input_ids=[1, POISON_TOKEN], sampling=GREEDY))
        results = eng.generate(requests)
        assert results[2].finish_reason == "error"
        assert "forward pass failed on this request" in results[2].error
        assert [r.output_ids for i, r in enumerate(results) if i != 2] == clean_outputs
        stats = eng.stats()
        assert stats["requests_failed_total"] == 1 and stats["num_running"] == 0
        eng.check_integrity()


def test_bad_ids_are_refused_at_submit(tiny_model_dir):
    with engine(tiny_model_dir) as eng:
        for continuation in ([-1], [49152], [[3, -7]]):
            conts = continuation if isinstance(continuation[0], list) else [continuation]
            with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
                eng.score(ScoreRequest(prefix=[1, 2, 3], continuations=conts))
        stop = SamplingParams(max_new_tokens=4, stop_token_ids=[-3])
        with pytest.raises(InvalidRequestError, match="stop token id -3"):
            eng.submit(GenerateRequest(input_ids=[1, 2], sampling=stop))
        assert eng.generate(valid_requests()[:1])[0].finish_reason == "length"
        assert eng.is_alive


def test_an_endless_required_schema_is_refused_quickly(tiny_model_dir):
    node = {
        "type": "object",
        "properties": {"child": {"$ref": "#/$defs/node"}},
        "required": ["child"],
    }
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    constraint = Constraint(json_schema=schema)
    request = GenerateRequest(
        text="{", sampling=SamplingParams(max_new_tokens=64), constraint=constraint
    )
    with engine(tiny_model_dir) as eng:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match="json_schema can never end"):
            eng.submit(request)
        branch = {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}], "$defs": {"node": node}}
        node["properties"]["child"]["$ref"] = "#/$defs/node"
        for endless in (
            Constraint(json_schema=branch),  # the endless branch can still be entered
            Constraint(grammar='root ::= "x" loop\nloop ::= "y" loop'),
        ):
            with pytest.raises(InvalidRequestError, match="can never end"):
                eng.submit(request.model_copy(update={"constraint": endless}))
        assert time.monotonic() - started < 30


def test_failing_commands_and_callbacks_never_stop_the_loop(tiny_model_dir, clean_outputs):
    with engine(tiny_model_dir) as eng:
        eng._loop.post(lambda: 1 / 0)  # a command that raises
        handle = eng.submit(valid_requests()[0])
        handle.push_chunk = lambda chunk: 1 / 0  # the caller's stream breaks
        assert handle.result(timeout=60).output_ids == clean_outputs[0]
        assert eng.is_alive and eng.fatal_error is None
        assert eng.generate(valid_requests())[3].output_ids == clean_outputs[3]
    assert not eng.is_alive


def test_a_request_past_its_timeout_is_aborted_and_the_rest_go_on(tiny_model_dir, clean_outputs):
    endless = SamplingParams(temperature=0, max_new_tokens=3000, ignore_eos=True)
    with engine(tiny_model_dir) as eng:
        slow = eng.submit(GenerateRequest(input_ids=[9, 8, 7], sampling=endless, timeout_s=0.5))
        results = eng.generate(valid_requests())
        result = slow.result(timeout=60)
        assert result.finish_reason == "abort" and "timeout passed" in result.error
        assert result.error_kind == "timeout"
        assert 0 < result.completion_tokens < 3000
        assert [r.output_ids for r in results] == clean_outputs
        eng.check_integrity()
