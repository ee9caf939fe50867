"""SGLang's native API over HTTP, field by field: every field SGLang 0.5.23 accepts is accepted
(honoured, ignored and logged, or refused by name), n samples, stop_regex, streamed running
meta_info, prompt logprobs and their top-k, and the routes besides /generate."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from runtime.server.sglang_ops import ProfileBody, model_path
from runtime.server.sglang_schemas import GenerateBody, SGLangSamplingParams

# SamplingParams fields SGLang fills itself ("not API-facing", its source says)
SGLANG_INTERNAL = {
    "stop_strs",
    "stop_regex_strs",
    "stop_str_max_len",
    "stop_regex_max_len",
    "is_normalized",
    "ebnf_full_assistant",
}


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def generate(client, **body):
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def sse_events(client, **body) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


# ---------------------------------------------------------------- every SGLang field
def sglang_fields(module: str, cls: str) -> set[str]:
    """The fields class `cls` of SGLang's installed source declares (read, not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    path = Path(spec.origin).parent / module
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.target.id for n in body if isinstance(n, ast.AnnAssign)}


def test_every_field_sglang_accepts_is_a_field_here():
    generate_fields = sglang_fields("srt/managers/io_struct.py", "GenerateReqInput")
    assert len(generate_fields) > 60 and not generate_fields - set(GenerateBody.model_fields)
    sampling = sglang_fields("srt/sampling/sampling_params.py", "SamplingParams")
    assert not sampling - SGLANG_INTERNAL - set(SGLangSamplingParams.model_fields)
    profile = sglang_fields("srt/managers/io_struct.py", "ProfileReq") - {"req_type"}
    assert not profile - set(ProfileBody.model_fields)


def test_every_field_unset_is_accepted(client):
    unset = {
        name: info.default
        for name, info in GenerateBody.model_fields.items()
        if name not in ("text", "input_ids", "sampling_params", "namespace")
    }
    out = generate(client, text="Hello", sampling_params={"max_new_tokens": 2}, **unset)
    assert out["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"image_data": "cat.png"}, "image_data"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"sampling_params": {"custom_params": {"k": 1}}}, "sampling_params.custom_params"),
        ({"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
    ],
)
def test_a_feature_flowlang_lacks_is_refused_by_name(client, extra, name):
    response = client.post("/generate", json={"text": "x", **extra})
    assert response.status_code == 400 and f"{name}: not supported" in response.text


def test_an_ignored_knob_is_accepted_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING, logger="runtime.server.sglang_api"):
        generate(
            client,
            text="x",
            routing_key="tenant-a",
            sampling_params={"max_new_tokens": 1, "stream_interval": 4},
        )
    (record,) = [r for r in caplog.records if hasattr(r, "fields_unhonoured")]
    assert record.fields_unhonoured == ["routing_key", "sampling_params.stream_interval"]


def test_null_means_the_default_as_in_sglang(client):
    out = generate(
        client,
        text="Code:",
        sampling_params={
            "temperature": None,
            "top_k": None,
            "stop": None,
            "regex": "[a-z]{3}",
            "max_new_tokens": None,
            "json_schema": "",
        },
        return_logprob=None,
        logprob_start_len=None,
    )
    assert len(out["text"]) == 3 and out["meta_info"]["finish_reason"]["type"] == "stop"


# ---------------------------------------------------------------- n, stop_regex, batches
def test_n_samples_per_prompt(client):
    three = generate(
        client,
        text="Tell me",
        rid="r",
        sampling_params={"n": 3, "max_new_tokens": 6, "sampling_seed": 1},
    )
    assert [o["meta_info"]["id"] for o in three] == ["r_0", "r_1", "r_2"]
    assert len({o["text"] for o in three}) > 1  # seed + i per sample
    four = generate(
        client, input_ids=[[5, 6, 7], [8, 9]], sampling_params={"n": 2, "max_new_tokens": 2}
    )
    assert [o["meta_info"]["prompt_tokens"] for o in four] == [3, 3, 2, 2]  # prompt-major


def test_stop_regex_over_http(client):
    free = generate(
        client, text="Count: one two", sampling_params={"max_new_tokens": 16, "temperature": 0}
    )
    assert any(c in "aeiou" for c in free["text"])
    out = generate(
        client,
        text="Count: one two",
        sampling_params={"max_new_tokens": 16, "temperature": 0, "stop_regex": "[aeiou]"},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[aeiou]"}
    assert free["text"].startswith(out["text"]) and not any(c in "aeiou" for c in out["text"])


def test_per_prompt_sampling_and_logprob_lists(client):
    out = generate(
        client,
        text=["a b c", "d e f"],
        sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 3}],
        return_logprob=[False, True],
        rid="batch",
    )
    assert [o["meta_info"]["completion_tokens"] for o in out] == [1, 3]
    assert "output_token_logprobs" not in out[0]["meta_info"]
    assert len(out[1]["meta_info"]["output_token_logprobs"]) == 3
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]


def test_cache_salt_and_prompt_token_ids(client):
    ids = list(range(700, 760))
    first = generate(client, input_ids=ids, cache_salt="s1", sampling_params={"max_new_tokens": 1})
    again = generate(
        client,
        input_ids=ids,
        cache_salt="s1",
        return_prompt_token_ids=True,
        sampling_params={"max_new_tokens": 1},
    )
    other = generate(client, input_ids=ids, cache_salt="s2", sampling_params={"max_new_tokens": 1})
    assert first["meta_info"]["cached_tokens"] == 0 == other["meta_info"]["cached_tokens"]
    assert again["meta_info"]["cached_tokens"] > 0 and again["prompt_token_ids"] == ids


# ---------------------------------------------------------------- logprobs
@pytest.mark.parametrize("start", [0, 3])
def test_input_logprobs_from_logprob_start_len(client, start):
    out = generate(
        client,
        text="The parcel left the depot on Monday.",
        sampling_params={"max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    inputs, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(inputs) == len(tops) == meta["prompt_tokens"] - start
    values = [lp for lp, _, _ in inputs]
    assert (values[0] is None) == (start == 0) and all(v < 0 for v in values[start == 0 :])
    assert all(len(top) == 2 for top in tops[start == 0 :]) and (tops[0] is None) == (start == 0)
    assert len(meta["output_top_logprobs"]) == 2


def test_unconditional_logprobs_when_nothing_is_generated(client):
    # the frontend's unconditional-likelihood select: ids, max_new_tokens 0, no start
    body = {
        "input_ids": [[11, 12, 13], [14, 15]],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
    }
    out = generate(client, **body)
    assert [len(o["meta_info"]["input_token_logprobs"]) for o in out] == [3, 2]
    assert out[0]["meta_info"]["input_token_logprobs"][0] == [None, 11, None]
    assert out[0]["meta_info"]["output_token_logprobs"] == []
    generating = generate(
        client, text="x", sampling_params={"max_new_tokens": 1}, return_logprob=True
    )
    assert generating["meta_info"]["input_token_logprobs"] == []  # SGLang's -1: output only


# ---------------------------------------------------------------- streaming
def test_stream_chunks_carry_the_running_meta_info(client):
    events = sse_events(
        client,
        text="The weather today",
        return_logprob=True,
        sampling_params={"max_new_tokens": 8, "temperature": 0},
    )
    assert len(events) > 2
    seen = 0  # output logprobs come as SGLang's frontend reads them: the new ones per chunk
    for event in events[:-1]:
        meta = event["meta_info"]
        assert meta["finish_reason"] is None and meta["prompt_tokens"] > 0
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - seen
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert event["text"] and len(event["output_ids"]) == meta["completion_tokens"]
        seen = meta["completion_tokens"]
    last = events[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == 8
    done = generate(
        client, text="The weather today", sampling_params={"max_new_tokens": 8, "temperature": 0}
    )
    assert events[-1]["text"] == done["text"]


def test_batch_and_n_streams_say_their_index(client):
    events = sse_events(client, text=["a", "b"], sampling_params={"max_new_tokens": 3, "n": 2})
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(e["meta_info"]["completion_tokens"] == 3 for e in finals.values())


# ---------------------------------------------------------------- the other routes
def test_model_and_server_info(client, served):
    info = client.get("/get_model_info").json()
    assert info["model_path"] == served.engine.config.model and info["is_generation"]
    assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
    assert client.get("/model_info").json() == info
    default = SimpleNamespace(config=SimpleNamespace(model="smollm2-135m-instruct"))
    assert model_path(default) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    server = client.get("/get_server_info").json()
    assert server["model_path"] == info["model_path"] and "stats" in server


def test_health_generate_encode_flush_profile_concatenate(client):
    assert client.get("/health_generate").status_code == 200
    encode = client.post("/encode", json={"text": "hi"})
    assert encode.status_code == 400 and "embedding model" in encode.text
    assert client.get("/flush_cache").status_code == 200
    assert client.get("/stop_profile").status_code == 400  # none running
    assert client.get("/start_profile").status_code == 200
    generate(client, text="profiled", sampling_params={"max_new_tokens": 3})
    profile = client.post("/stop_profile").json()
    assert profile["counters"]["decode_tokens_total"] >= 2
    joined = client.post("/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"})
    assert joined.status_code == 200 and joined.json()["success"]
    bad = client.post("/concate_and_append_request", json={"src_rids": "a"})
    assert bad.status_code == 422
