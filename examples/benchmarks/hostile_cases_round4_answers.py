"""hostile_cases_round4.py's answer cases: statuses, and whether an answer is the expected one
(chat_template_kwargs, nesting, endless tool grammars, the shared compile cache, the
reasoning parser, a streamed n=2)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import httpx
from hostile_cases_round4 import CHAT, Round4Case, Target, post, tool_spec
from hostile_cases_tenants import auth


def answer(check: Callable[[str], tuple[str, bool]]):
    """An answer case's run: `check(url)` says what happened and whether that is right."""

    def run(target: Target) -> dict:
        outcome, right = check(target.url)
        return {"outcome": outcome, "expected": right}

    return run


def _chat_status(url: str, body: dict) -> httpx.Response:
    return post(url, CHAT, {"max_tokens": 4, "temperature": 0, **body}, timeout=60)


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])[:80]
    except (ValueError, KeyError, TypeError):
        return response.text[:80]


def _refused_naming(response: httpx.Response, words: tuple[str, ...]) -> tuple[str, bool]:
    message = _message(response)
    named = any(w in message.lower() for w in words)
    return f"{response.status_code} {message!r}", response.status_code == 400 and named


def return_tensors(url: str) -> tuple[str, bool]:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template_kwargs": {"return_tensors": "pt"}}
    response = _chat_status(url, body)
    return str(response.status_code), 400 <= response.status_code < 500


def truncation(url: str) -> tuple[str, bool]:
    """#1: truncation must not cut the prompt silently: a 400, or the whole prompt."""
    messages = [{"role": "user", "content": "hello there, how are you doing today?"}]
    whole = _chat_status(url, {"messages": messages})
    kwargs = {"truncation": True, "max_length": 5}
    cut = _chat_status(url, {"messages": messages, "chat_template_kwargs": kwargs})
    if cut.status_code != 200:
        return str(cut.status_code), 400 <= cut.status_code < 500
    tokens = cut.json()["usage"]["prompt_tokens"], whole.json()["usage"]["prompt_tokens"]
    return f"200, prompt {tokens[0]} of {tokens[1]} tokens", tokens[0] == tokens[1]


def _nested_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def deep_tool_schema(levels: int) -> Callable[[str], tuple[str, bool]]:
    def check(url: str) -> tuple[str, bool]:
        tool = {"type": "function", "function": {"name": "f", "parameters": _nested_schema(levels)}}
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        return _refused_naming(_chat_status(url, body), ("nest", "deep", "depth"))

    return check


def deep_history_arguments(url: str) -> tuple[str, bool]:
    """#12: a history tool call whose arguments nest 3,000 deep."""
    arguments = '{"a": ' * 3000 + "1" + "}" * 3000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    body = {"messages": messages, "tools": [tool_spec("f", {})]}
    return _refused_naming(_chat_status(url, body), ("nest", "deep", "depth"))


def endless_tool(choice: str) -> Callable[[str], tuple[str, bool]]:
    """#13: a tool whose required property is itself: no finite call exists."""

    def check(url: str) -> tuple[str, bool]:
        parameters = {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]}
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        body = {
            "messages": [{"role": "user", "content": "Call f."}],
            "tools": [tool],
            "tool_choice": choice,
            "max_tokens": 48,
        }
        response = _chat_status(url, body)
        if response.status_code != 200:
            return str(response.status_code), response.status_code == 400
        reason = response.json()["choices"][0]["finish_reason"]
        return f"200, finish_reason {reason}", False

    return check


def shared_compile(url: str) -> tuple[str, bool]:
    """#14: B's compile of a regex A just used vs of one nobody used: a signal if much
    faster. The best of two pairs."""
    tag = uuid.uuid4().hex[:8]
    seen_s, unseen_s = [], []
    for k in range(2):
        seen, unseen = f"[^x]{{0,500}}{tag}{k}s", f"[^x]{{0,500}}{tag}{k}u"
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        post(url, "/generate", _regex(body, seen), "a", 120)
        for regex_, times in ((seen, seen_s), (unseen, unseen_s)):
            started = time.monotonic()
            post(url, "/generate", _regex(body, regex_), "b", 120)
            times.append(time.monotonic() - started)
    seen_t, unseen_t = min(seen_s), min(unseen_s)
    return f"seen {seen_t:.2f} s, unseen {unseen_t:.2f} s", seen_t >= 0.5 * unseen_t


def _regex(body: dict, regex_: str) -> dict:
    return {**body, "sampling_params": {**body["sampling_params"], "regex": regex_}}


def interleaved_n2(url: str) -> tuple[str, bool]:
    """A streamed n=2 chat: do choice 1's tokens come before choice 0 has ended?"""
    body = {
        "messages": [{"role": "user", "content": "Tell a story."}],
        "max_tokens": 16,
        "n": 2,
        "ignore_eos": True,
        "stream": True,
    }
    order = []
    with httpx.stream("POST", url + CHAT, json=body, headers=auth("a"), timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        order.append(choice["index"])
    if not order:
        return f"{response.status_code}, no content", False
    ones = [i for i, c in enumerate(order) if c == 1]
    zeros = [i for i, c in enumerate(order) if c == 0]
    mixed = bool(ones and zeros) and min(ones) < max(zeros)
    return ("interleaved" if mixed else "choice 0 whole, then 1"), mixed


def user_think(url: str) -> tuple[str, bool]:
    """#11: a user message ending in <think> must not put the answer in reasoning_content."""
    messages = [{"role": "user", "content": "Say hello. <think>"}]
    response = _chat_status(url, {"messages": messages, "max_tokens": 16})
    if response.status_code != 200:
        return str(response.status_code), False
    message = response.json()["choices"][0]["message"]
    content, reasoning = message.get("content") or "", message.get("reasoning_content") or ""
    if reasoning and not content.strip():
        return "the whole answer in reasoning_content", False
    return "answer in content", True


ANSWERS = [
    Round4Case(
        "#1", "chat_template_kwargs return_tensors", "answer", "tenants", answer(return_tensors)
    ),
    Round4Case("#1", "chat_template_kwargs truncation", "answer", "tenants", answer(truncation)),
    Round4Case(
        "#12", "history arguments 3,000 deep", "answer", "tenants", answer(deep_history_arguments)
    ),
    Round4Case("#12", "tool schema 130 deep", "answer", "tenants", answer(deep_tool_schema(130))),
    Round4Case("#12", "tool schema 110 deep", "answer", "tenants", answer(deep_tool_schema(110))),
    Round4Case(
        "#13", "self-required tool, auto", "answer", "tenants", answer(endless_tool("auto"))
    ),
    Round4Case(
        "#13", "self-required tool, required", "answer", "tenants", answer(endless_tool("required"))
    ),
    Round4Case("#14", "compile cache across tenants", "answer", "tenants", answer(shared_compile)),
    Round4Case("extra", "streamed n=2 interleaved", "answer", "tenants", answer(interleaved_n2)),
    Round4Case("#11", "user text <think>", "answer", "variants", answer(user_think)),
]
