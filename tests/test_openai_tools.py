"""Agents over the OpenAI API: tools, tool_choice in all four forms, parallel_tool_calls, tool
calls and tool results in the history, streamed delta.tool_calls, reasoning_content, and the
request audit (every field honoured, ignored or refused by name), with the real `openai`
client and LangChain's ChatOpenAI against `flowlang serve`.

The tiny random model knows no tools, so it calls only where decoding is constrained to: every
call it returns must still name a real tool and validate against its schema.
"""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest
from conftest import ServerThread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from runtime.config import EngineConfig
from runtime.engine import Engine

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHOICES = ["required", {"type": "function", "function": {"name": "add"}}, "auto", "none"]


def check_call(call, tools=TOOLS) -> dict:
    """A returned call names a real tool and its arguments validate; returns them."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    assert call.function.name in schemas, call.function.name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    return arguments


@pytest.fixture(scope="module")
def oc(served):
    return OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def test_tool_choice_four_forms_in_a_multi_step_loop(oc):
    """An agent loop: each step's calls are answered with role "tool" messages that name the
    call; the forms of tool_choice each do what they say."""
    messages = [{"role": "user", "content": "What is 2 + 3, and the weather in Oslo?"}]
    for step, choice in enumerate(CHOICES):
        answer = oc.chat.completions.create(
            model=oc.models.list().data[0].id,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=96,
            temperature=0.8,
            seed=step,
        )
        message = answer.choices[0].message
        calls = message.tool_calls or []
        if choice == "none":
            assert not calls and answer.choices[0].finish_reason in ("stop", "length")
            assert "<tool_call>" not in (message.content or "")
            break
        if choice != "auto":  # constrained from the first token: exactly one call
            assert len(calls) == 1 and answer.choices[0].finish_reason == "tool_calls"
            assert message.content is None
        if isinstance(choice, dict):
            assert calls[0].function.name == "add"
        for call in calls:
            check_call(call)
        messages.append(message.model_dump(exclude_none=True))
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"ok": 1}'})
    assert len(messages) >= 5  # three steps of calls and results reached the template


def test_streamed_tool_calls_reassemble_to_the_unstreamed_answer(oc):
    kwargs = dict(
        model=oc.models.list().data[0].id,
        messages=[{"role": "user", "content": "Add 1 and 2."}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    whole = oc.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in oc.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            if delta.id:
                assert call["id"] is None  # the id comes once, with the name
                call["id"], call["name"] = delta.id, delta.function.name
            call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_parallel_calls_and_their_results_in_history(oc):
    answer = oc.chat.completions.create(
        model=oc.models.list().data[0].id,
        messages=[{"role": "user", "content": "Two sums, please."}],
        tools=[ADD],
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=80,
        temperature=1.0,
        seed=3,
    )
    calls = answer.choices[0].message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        check_call(call, [ADD])
    history = [
        {"role": "user", "content": "Two sums, please."},
        answer.choices[0].message.model_dump(exclude_none=True),
        *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in calls),
    ]
    follow = oc.chat.completions.create(
        model=oc.models.list().data[0].id, messages=history, tools=[ADD], max_tokens=4
    )
    assert follow.usage.prompt_tokens > answer.usage.prompt_tokens
    # the template-less fallback shows the calls as the model writes them, and the results
    assert follow.usage.prompt_tokens_details.cached_tokens > 0


json_schemas = st.deferred(
    lambda: st.one_of(
        st.just({"type": "boolean"}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.lists(st.sampled_from(["x", "y", "z", "é"]), min_size=1, max_size=3, unique=True).map(
            lambda values: {"type": "string", "enum": values}
        ),
        st.builds(
            lambda item, n: {"type": "array", "items": item, "maxItems": n},
            st.one_of(st.just({"type": "boolean"}), st.just({"type": "string", "maxLength": 3})),
            st.integers(0, 3),
        ),
    )
)
object_schemas = st.dictionaries(
    st.from_regex(r"[a-z][a-z_]{0,7}", fullmatch=True), json_schemas, min_size=0, max_size=4
).flatmap(
    lambda props: st.builds(
        lambda required: {"type": "object", "properties": props, "required": required},
        st.lists(st.sampled_from(sorted(props)), unique=True) if props else st.just([]),
    )
)
tool_sets = st.lists(
    st.tuples(st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True), object_schemas),
    min_size=1,
    max_size=3,
    unique_by=lambda t: t[0],
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tool_sets, st.sampled_from(["required", "named", "auto"]), st.integers(0, 2**16))
def test_generated_schemas_every_call_validates(oc, tool_set, choice, seed):
    """Hypothesis-made tool schemas, sampled at temperature 1 (n=4 choices each): not one
    returned call fails to parse, names an unknown tool or breaks its schema."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": schema}}
        for name, schema in tool_set
    ]
    tool_choice = (
        {"type": "function", "function": {"name": tool_set[0][0]}} if choice == "named" else choice
    )
    answer = oc.chat.completions.create(
        model=oc.models.list().data[0].id,
        messages=[{"role": "user", "content": "Call a tool."}],
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=1.0,
        seed=seed,
        n=4,
    )
    for c in answer.choices:
        for call in c.message.tool_calls or []:
            check_call(call, tools)
        if choice != "auto" and c.finish_reason != "length":
            assert len(c.message.tool_calls or []) == 1, c.message


# ---------------------------------------------------------------- the request audit
@pytest.mark.parametrize(
    "extra, status, named",
    [
        ({"no_such_field": 1}, 422, "no_such_field"),
        ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"functions": [{"name": "f"}]}, 400, "functions"),
        ({"store": True}, 400, "store"),
        ({"reasoning_effort": "high"}, 400, "reasoning_effort"),
        ({"audio": {"voice": "x"}}, 400, "audio"),
        ({"modalities": ["audio"]}, 422, "modalities"),
        ({"tools": [{"type": "custom", "custom": {}}]}, 422, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 422, "name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         422, "tool_choice"),
        ({"tool_choice": "required"}, 422, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, 422, "own name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         400, "schema"),
        ({"messages": [{"role": "tool", "content": "5"}]}, 422, "tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]}]}, 422, "tool_calls"),
        ({"messages": [{"role": "function", "content": "x"}]}, 422, "role"),
        ({"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
        ({"tools": [ADD], "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"stream_options": {"continuous_usage_stats": True}, "stream": True}, 400,
         "continuous_usage_stats"),
    ],
)  # fmt: skip
def test_every_field_is_honoured_or_refused_by_name(served, extra, status, named):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert named in response.json()["error"]["message"]


def test_ignored_fields_are_accepted_and_logged(served, caplog):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "prompt_cache_key": "p",
        "service_tier": "auto",
        "store": False,
        "modalities": ["text"],
    }
    with caplog.at_level("WARNING", logger="flowlang.server"):
        response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    logged = " ".join(r.getMessage() for r in caplog.records)
    for name in ("user", "metadata", "prompt_cache_key", "service_tier"):
        assert name in logged


def test_completions_echo_and_extensions(oc):
    done = oc.completions.create(
        model=oc.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        echo=True,
        extra_body={"top_k": 1, "repetition_penalty": 1.1},
    )
    assert done.choices[0].text.startswith("Once upon a time")
    plain = oc.completions.create(
        model=oc.models.list().data[0].id,
        prompt="Once upon a time",
        max_tokens=4,
        temperature=0,
        extra_body={"top_k": 1, "repetition_penalty": 1.1},
    )
    assert done.choices[0].text == "Once upon a time" + plain.choices[0].text


# ---------------------------------------------------------------- templates that know tools
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    '{% endfor %}\nCall as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}"
    "{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def _with_template(tmp_path, tiny_model_dir, template: str):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def test_a_template_with_tools_renders_definitions_calls_and_results(tmp_path, tiny_model_dir):
    folder = _with_template(tmp_path, tiny_model_dir, TOOL_TEMPLATE)
    engine = Engine(EngineConfig(model=str(folder), max_kv_tokens=4096))
    assert engine.tool_format == "hermes"
    thread = ServerThread(engine)
    try:
        oc = OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        first = oc.chat.completions.create(
            model=oc.models.list().data[0].id,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
            temperature=0,
        )
        call = first.choices[0].message.tool_calls[0]
        check_call(call, [WEATHER])
        history = [
            {"role": "user", "content": "weather?"},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        prompt = engine.tokenizer.apply_chat_template(
            [history[0], {"role": "assistant", "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments)}}]},
             history[2]],
            tools=[WEATHER], add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        assert "TOOLS: get_weather" in prompt and "<tool_response>\nsunny" in prompt
        follow = oc.chat.completions.create(
            model=oc.models.list().data[0].id,
            messages=history,
            tools=[WEATHER],
            max_tokens=3,
            temperature=0,
        )
        assert follow.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    finally:
        thread.stop()
        engine.close()


def test_reasoning_content_split_and_streamed(tmp_path, tiny_model_dir):
    folder = _with_template(tmp_path, tiny_model_dir, THINK_TEMPLATE)
    engine = Engine(EngineConfig(model=str(folder), max_kv_tokens=4096))
    assert engine.reasoning_format == "deepseek-r1"
    thread = ServerThread(engine)
    try:
        oc = OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        kwargs = dict(
            model=oc.models.list().data[0].id,
            messages=[{"role": "user", "content": "Think."}],
            max_tokens=24,
            seed=1,
        )
        raw = oc.chat.completions.create(**kwargs, extra_body={"separate_reasoning": False})
        split = oc.chat.completions.create(**kwargs)
        text = raw.choices[0].message.content
        message = split.choices[0].message.model_dump()
        reasoning, content = message.get("reasoning_content"), message["content"] or ""
        if "</think>" in text:
            before, after = text.split("</think>", 1)
            assert reasoning == before.strip() and content == after.strip()
        else:  # cut by max_tokens inside the block: all of it is reasoning
            assert reasoning == text.strip() and content == ""
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in oc.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta.model_dump()
            for key in streamed:
                streamed[key] += delta.get(key) or ""
        assert streamed == {"reasoning_content": reasoning or "", "content": content}
        off = oc.chat.completions.create(
            **kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert off.usage.prompt_tokens > raw.usage.prompt_tokens  # the template's empty block
        assert off.choices[0].message.model_dump().get("reasoning_content") is None
    finally:
        thread.stop()
        engine.close()


def test_a_schema_applies_to_the_answer_after_the_reasoning(tmp_path, tiny_model_dir):
    """With response_format, the reasoning is free text and the answer after it validates;
    max_reasoning_tokens closes the reasoning block."""
    folder = _with_template(tmp_path, tiny_model_dir, THINK_TEMPLATE)
    engine = Engine(EngineConfig(model=str(folder), max_kv_tokens=8192))
    thread = ServerThread(engine)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    try:
        oc = OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0)
        answer = oc.chat.completions.create(
            model=oc.models.list().data[0].id,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            max_tokens=48,
            temperature=1.0,
            seed=0,
            n=8,
        )
        # a random model never closes its thinking by itself: a budget closes it
        assert not [c for c in answer.choices if c.finish_reason == "stop"]
        answer = oc.chat.completions.create(
            model=oc.models.list().data[0].id,
            messages=[{"role": "user", "content": "Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            max_tokens=48,
            temperature=1.0,
            seed=0,
            n=8,
            extra_body={"max_reasoning_tokens": 8},
        )
        finished = [c for c in answer.choices if c.finish_reason == "stop"]
        assert len(finished) >= 6
        for c in finished:
            jsonschema.validate(json.loads(c.message.content), schema)
            assert "</think>" not in c.message.content
        for c in answer.choices:
            assert c.message.model_dump().get("reasoning_content") is not None
    finally:
        thread.stop()
        engine.close()


# ---------------------------------------------------------------- a second real client
def test_langchain_chat_openai_tool_loop(served):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatOpenAI(
        base_url=served.url + "/v1",
        api_key="unused",
        model=served.engine.config.model,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    bound = llm.bind_tools([add], tool_choice="add", parallel_tool_calls=False)
    messages = [HumanMessage("What is 2 + 3?")]
    for streaming in (False, True):
        if streaming:
            reply = None
            for piece in bound.stream(messages):
                reply = piece if reply is None else reply + piece
        else:
            reply = bound.invoke(messages)
        assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "add"
        args = reply.tool_calls[0]["args"]
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
        result = ToolMessage(str(add.invoke(args)), tool_call_id=reply.tool_calls[0]["id"])
        messages += [reply, result]
    final = llm.invoke(messages)
    assert isinstance(final.content, str)


def test_a_special_token_call_marker_is_kept_in_the_text():
    """Mistral writes `[TOOL_CALLS]` as a special token, which decoding would drop (and the
    call with it): such a request keeps special tokens in its text."""
    from types import SimpleNamespace

    from runtime.server.chat_turn import _is_special_token

    def tokenizer(*specials: str):
        added = {i: SimpleNamespace(content=t, special=True) for i, t in enumerate(specials)}
        return SimpleNamespace(added_tokens_decoder=added)

    assert _is_special_token(tokenizer("[TOOL_CALLS]", "</s>"), "[TOOL_CALLS]")
    assert not _is_special_token(tokenizer("</s>"), "[TOOL_CALLS]")
    assert not _is_special_token(tokenizer("</s>"), "<tool_call>")
