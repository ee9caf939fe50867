"""Issue 50's hostile cases on chat planning and text parsing: chat_template_kwargs passes only
template variables, within a size limit, rendered on a few threads shared fairly between keys
(#1); tool-call parsing is linear, bounded and off the event loop (#2); SGLang's /generate
tokenizes off the event loop when it needs a prompt's length (#7); a user who writes
`<think>` does not put the answer into reasoning_content (#11)."""

from __future__ import annotations

import asyncio
import copy
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from conftest import ServerThread

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.protocol import GenerateResult, ToolSpec
from runtime.server.schemas import ChatBody

KEYS = ("alice-key", "bob-key")
TOOLS = [ToolSpec(name="f", parameters={"type": "object", "properties": {}})]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = Engine(
        EngineConfig(model=str(tiny_model_dir), max_kv_tokens=20_000, reasoning_parser="think")
    )
    thread = ServerThread(engine, api_keys=KEYS)
    yield thread
    thread.stop()
    engine.close()


def post(server, path: str, body: dict, key: str = KEYS[0]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def chat(content: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def stub_engine(tokenizer, reasoning: str | None = "think") -> SimpleNamespace:
    """What plan_chat reads of an engine."""
    return SimpleNamespace(tokenizer=tokenizer, tool_format="hermes", reasoning_format=reasoning)


# ------------------------------------------------------------ #1 chat_template_kwargs


def _apply_chat_template_arguments() -> list[str]:
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return [
        p.name
        for p in parameters.values()
        if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]


@pytest.mark.parametrize("key", _apply_chat_template_arguments())
def test_no_argument_of_apply_chat_template_passes_as_a_template_variable(key, default_tokenizer):
    """Every named parameter of transformers' apply_chat_template (chat_template, padding,
    max_length, truncation, return_tensors, tokenizer_kwargs, ...) is refused by name."""
    from runtime.server.chat_turn import plan_chat

    body = ChatBody(**chat(chat_template_kwargs={key: 1}))
    with pytest.raises(InvalidRequestError, match=key):
        plan_chat(stub_engine(default_tokenizer, None), body)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chat_template": "{% for i in range(3) %}x{% endfor %}"},
        {"padding": "max_length", "max_length": 100_000},
        {"truncation": True, "max_length": 3},
        {"return_tensors": "pt"},
        {"return_assistant_tokens_mask": True},
        {"tokenizer_kwargs": {"padding": "max_length"}},
    ],
)
def test_tokenizer_arguments_in_chat_template_kwargs_are_a_400(server, kwargs):
    response = post(server, "/v1/chat/completions", chat(chat_template_kwargs=kwargs))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "chat_template_kwargs" in message and any(k in message for k in kwargs)


def test_template_variables_still_pass_and_their_size_is_bounded(server):
    from runtime.server.chat_turn import MAX_TEMPLATE_KWARGS_CHARS

    ok = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": 0}))
    assert ok.status_code == 200, ok.text
    big = {"note": "x" * MAX_TEMPLATE_KWARGS_CHARS}
    response = post(server, "/v1/chat/completions", chat(chat_template_kwargs=big))
    assert response.status_code == 400, response.text
    assert str(MAX_TEMPLATE_KWARGS_CHARS) in response.json()["error"]["message"]


def test_chat_planning_runs_on_a_few_threads_a_bounded_share_per_key(server, monkeypatch):
    """One key's slow templates hold at most its share of the planning threads (never the
    default pool every route shares): another key's chat is planned meanwhile."""
    import runtime.server.openai_api as openai_api

    real_plan, release = openai_api.plan_chat, threading.Event()
    lock, running, most, threads = threading.Lock(), {"alice": 0, "bob": 0}, {"alice": 0}, set()

    def slow_plan(engine, body):
        who = body.messages[0].content.split("-")[0]
        with lock:
            running[who] += 1
            most[who] = max(most.get(who, 0), running[who])
            threads.add(threading.current_thread().name)
        try:
            if who == "alice":
                assert release.wait(60), "the test never released alice's templates"
            return real_plan(engine, body)
        finally:
            with lock:
                running[who] -= 1

    monkeypatch.setattr(openai_api, "plan_chat", slow_plan)
    with ThreadPoolExecutor(8) as pool:
        try:
            alice = [
                pool.submit(post, server, "/v1/chat/completions", chat(f"alice-{i}"))
                for i in range(5)
            ]
            deadline = time.monotonic() + 30
            while most["alice"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # room for any more of alice's plans to start (they must not)
            bob = post(server, "/v1/chat/completions", chat("bob-0"), key=KEYS[1])
            assert bob.status_code == 200, bob.text  # planned while alice's were blocked
            assert most["alice"] <= 2
        finally:
            release.set()
        assert all(f.result().status_code == 200 for f in alice)
    assert threads and all(name.startswith("text-work") for name in threads), threads


def test_a_key_with_too_many_texts_waiting_gets_a_429():
    from runtime.server.errors import TooManyRequestsError
    from runtime.server.tenant_pool import TenantPool

    pool, release = TenantPool(threads=2, per_tenant=1, name="test-pool"), threading.Event()

    async def scenario():
        first = asyncio.ensure_future(pool.run("a", 1, release.wait, 30))
        second = asyncio.ensure_future(pool.run("a", 1, release.wait, 30))
        await asyncio.sleep(0.1)
        with pytest.raises(TooManyRequestsError):
            await pool.run("a", 1, release.wait, 30)  # one running, one waiting: full
        assert await asyncio.wait_for(pool.run("b", 1, lambda: "b's"), 10) == "b's"
        release.set()
        assert await asyncio.gather(first, second) == [True, True]

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert pool.running("a") == 0


# ------------------------------------------------------------ #2 /parse_function_call


class _CountingText(str):
    """A text that counts the characters read from it one at a time."""

    reads = 0

    def __getitem__(self, key):
        if isinstance(key, int):
            _CountingText.reads += 1
        return str.__getitem__(self, key)


@pytest.mark.parametrize(
    "fmt, unit",
    [
        ("llama3", '[{"name": '),
        ("llama3", '{"name": '),
        ("llama3", '<|python_tag|>[{"name": '),
        ("hermes", '<tool_call>{"a": ['),
        ("mistral", '[TOOL_CALLS] [{"a": ['),
    ],
)
def test_tool_call_parsing_reads_each_character_a_bounded_number_of_times(fmt, unit):
    """Text that opens a call at every bracket and fails only at its very end was read again
    from every opening (quadratic: 48 kB took 39 s on the event loop); now a bracket inside
    a value read already is known with it."""
    from runtime.constrain.tool_calls import tool_format

    text = _CountingText(unit * 400 + "x")
    _CountingText.reads = 0
    parsed = tool_format(fmt).parse(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text
    assert _CountingText.reads <= 4 * len(text), _CountingText.reads
    stream, cut = tool_format(fmt).stream(TOOLS), 7
    _CountingText.reads = 0
    for at in range(0, len(text), cut):
        stream.feed(_CountingText(text[at : at + cut]))
    stream.finish()
    assert _CountingText.reads <= 4 * len(text), _CountingText.reads


PARSE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("llama3", '{"name": {}, "parameters": {}}'),
        ("hermes", '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>'),
        ("mistral", '[TOOL_CALLS] [{"name": {"f": 1}, "arguments": {}}]'),
    ],
)
def test_a_call_whose_name_is_no_string_stays_text(server, fmt, text):
    """An object or a list as a call's name is text, not a 500 (`{} in tools` raised)."""
    body = {"text": text, "tools": PARSE_TOOLS, "tool_call_parser": fmt}
    response = post(server, "/parse_function_call", body)
    assert response.status_code == 200, response.text
    assert response.json() == {"normal_text": text, "calls": []}


def test_parse_function_call_text_is_bounded(server):
    from runtime.server.sglang_ops import MAX_PARSE_TEXT_CHARS

    text = "a" * (MAX_PARSE_TEXT_CHARS + 1)
    body = {"text": text, "tools": PARSE_TOOLS, "tool_call_parser": "llama3"}
    response = post(server, "/parse_function_call", body)
    assert response.status_code == 400, response.text
    assert str(MAX_PARSE_TEXT_CHARS) in response.json()["error"]["message"]


def test_parse_function_call_parses_off_the_event_loop(server, monkeypatch):
    from runtime.constrain import tool_calls

    tools, real_parse, threads = PARSE_TOOLS, tool_calls.ToolFormat.parse, []

    def parse(self, text, tools):
        threads.append(threading.current_thread())
        return real_parse(self, text, tools)

    monkeypatch.setattr(tool_calls.ToolFormat, "parse", parse)
    text = 'ok {"name": "f", "parameters": {"a": 1}}'
    body = {"text": text, "tools": tools, "tool_call_parser": "llama3"}
    response = post(server, "/parse_function_call", body)
    assert response.status_code == 200, response.text
    assert response.json()["calls"] == [{"tool_index": 0, "name": "f", "parameters": '{"a": 1}'}]
    assert threads and server.thread not in threads  # the event loop's thread never parses


# ------------------------------------------------------------ #7 SGLang /generate


def test_generate_with_a_default_max_new_tokens_tokenizes_off_the_event_loop(server, monkeypatch):
    """max_new_tokens null: the prompt's length sets it, and the text is tokenized in a worker
    thread (a 7.5 MB text held /health 4.5-13 s when it was tokenized on the event loop)."""
    intake = server.engine.intake
    real_tokens, threads = intake.tokens, []

    def tokens(text_or_ids, special):
        threads.append(threading.current_thread())
        return real_tokens(text_or_ids, special)

    room = min(server.engine.arch.max_context_len, intake.num_slots)
    text = " hello" * (room - 3)  # a long prompt: a short default answer
    num_prompt = len(real_tokens(text, True))
    assert 0 < room - num_prompt <= 8
    monkeypatch.setattr(intake, "tokens", tokens)
    body = {
        "text": text,
        "sampling_params": {"max_new_tokens": None, "temperature": 0},
        "return_prompt_token_ids": True,
    }
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["meta_info"]["prompt_tokens"] == num_prompt
    assert len(out["prompt_token_ids"]) == num_prompt
    assert out["meta_info"]["completion_tokens"] <= room - num_prompt
    assert threads and server.thread not in threads


# ------------------------------------------------------------ #11 reasoning from user text


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def _result(text: str) -> GenerateResult:
    return GenerateResult(
        rid="r", text=text, output_ids=[], finish_reason="stop", prompt_tokens=1,
        cached_tokens=0, completion_tokens=1,
    )  # fmt: skip


def test_a_user_message_ending_in_think_opens_no_reasoning_block(default_tokenizer):
    from runtime.server.chat_turn import chat_message, plan_chat

    engine = stub_engine(default_tokenizer)
    for content in ("Say <think>", "<think>", "tell me about </think> and <think>"):
        plan = plan_chat(engine, ChatBody(**chat(content)))
        assert not plan.in_reasoning, content
        message, _ = chat_message(plan, _result("The answer."))
        assert message["content"] == "The answer."
        assert message.get("reasoning_content") is None
    # a template whose generation prompt opens the block: the answer starts inside it
    thinking = copy.deepcopy(default_tokenizer)
    thinking.chat_template = THINK_TEMPLATE
    plan = plan_chat(stub_engine(thinking), ChatBody(**chat("hi")))
    assert plan.in_reasoning
    message, _ = chat_message(plan, _result("hmm</think>The answer."))
    assert message == {"role": "assistant", "content": "The answer.", "reasoning_content": "hmm"}
    # the client's own assistant prefix, continued, may open it
    prefix = {"role": "assistant", "content": "<think>\nLet me see"}
    body = ChatBody(
        messages=[{"role": "user", "content": "hi"}, prefix],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert plan_chat(engine, body).in_reasoning


def test_served_chat_with_think_in_the_user_message_answers_in_content(server):
    response = post(server, "/v1/chat/completions", chat("Repeat after me: <think>"))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message.get("reasoning_content") is None, message
