"""Chat messages with tools, for templates that know no tools (SmolLM2's ChatML, say).

A template that renders `tools` gets the messages as OpenAI sends them (function arguments as
objects, as Hugging Face templates expect). One that does not gets them rewritten into plain
messages every template takes: the tool definitions and how to call them appended to the
system message, each assistant call written as the model's tool format writes it (so history
and fresh output look alike), and tool results as a user message of `<tool_response>` blocks
(Qwen2.5's convention). Torch-free: the language renders its prompts with it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from runtime.constrain.check import nests_deeper
from runtime.constrain.tool_calls import ToolFormat
from runtime.protocol import ToolSpec


def openai_tools(tools: Sequence[ToolSpec]) -> list[dict]:
    """The tools as OpenAI's request (and Hugging Face templates) spell them."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
            },
        }
        for t in tools
    ]


def tools_block(tools: Sequence[ToolSpec], fmt: ToolFormat) -> str:
    """The fallback's tool section: the definitions, and one call written as `fmt` writes it."""
    definitions = "\n".join(json.dumps(d, ensure_ascii=False) for d in openai_tools(tools))
    example = fmt.call_text("function_name", {"argument": "value"})
    return (
        "# Tools\n\n"
        "You can call the functions defined below (one JSON definition per line) to help "
        "with the request.\n<tools>\n"
        f"{definitions}\n</tools>\n\n"
        "To call one, answer with the call and nothing else, written exactly like this "
        "(several calls: one after another):\n"
        f"{example}"
    )


def tool_response_text(content: str) -> str:
    """One tool result as the fallback shows it to the model."""
    return f"<tool_response>\n{content}\n</tool_response>"


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as an object (OpenAI sends a JSON text; templates want the object);
    text that is not JSON stays text."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def arguments_nest_too_deep(arguments: Any) -> bool:
    """Whether a call's arguments (JSON text, or the object) nest deeper than json_schema's
    limit (check.MAX_NESTING_DEPTH): rendering them would recurse per level."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return False  # text that is not JSON stays text: nothing nests
        except RecursionError:  # deeper than the parser goes: far past the limit
            return True
    return nests_deeper(arguments)


def fallback_messages(
    messages: Sequence[dict], tools: Sequence[ToolSpec], fmt: ToolFormat
) -> list[dict]:
    """`messages` (OpenAI-shaped dicts: role, content, tool_calls, tool_call_id) rewritten for
    a template without tool support: roles system/user/assistant only, content text only."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "developer":
            role = "system"
        if role == "tool":
            block = tool_response_text(content)
            if out and out[-1].get("tool_responses"):  # consecutive results: one message
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_responses": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                (c["function"]["name"], arguments_object(c["function"].get("arguments") or {}))
                for c in message["tool_calls"]
            ]
            written = fmt.calls_text(calls)
            content = f"{content}\n{written}" if content else written
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_responses", None)
    if tools:
        block = tools_block(tools, fmt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """`messages` for a template that renders tools: call arguments as objects."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": arguments_object(call["function"].get("arguments") or {}),
                    },
                }
                for call in message["tool_calls"]
            ]
        out.append(message)
    return out
