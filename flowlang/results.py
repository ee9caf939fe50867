"""What a gen asks of the engine and what its result puts into its state: the constraint it
decodes under (built when it runs: tool calls and reasoning depend on the backend's model),
then the tokens appended, the value and its meta.

A gen with tools decodes under the tool format's structural tag (free text, and any call held
to a real tool and its schema); with reasoning, its constraint applies after the `</think>`.
The output stays in the state as decoded; only the value is taken apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowlang.backends.base import Backend
from flowlang.errors import InvalidOutputError, ProgramError
from flowlang.ir import Gen
from flowlang.tools import calls_from
from runtime.protocol import Constraint, GenerateResult, ToolCall


@dataclass(frozen=True)
class OutputFormat:
    """One gen's output format, resolved against the backend: what constrains the decoding
    and how its text is taken apart (reasoning block, tool calls)."""

    constraint: Constraint | None
    reasoning: Any = None  # a runtime ReasoningFormat, or None
    in_reasoning: bool = False  # the prompt already opened the reasoning block
    tool_format: Any = None  # a runtime ToolFormat (a gen with tools), or None


def output_format(node: Gen, backend: Backend, prompt_text: str) -> OutputFormat:
    """How `node` decodes on `backend` after `prompt_text`."""
    if not node.tools and not node.reasoning:
        return OutputFormat(node.constraint)
    from runtime.constrain.tool_calls import InvalidTools, output_constraint, tool_format

    reasoning = _reasoning_format(node, backend)
    # deepseek-r1 outputs start inside the block even when the prompt has not opened it (as
    # SGLang's parser reads them); "think" outputs do when the prompt opened one
    in_reasoning = reasoning is not None and (
        reasoning.name == "deepseek-r1" or reasoning.in_reasoning(prompt_text)
    )
    fmt = tool_format(backend.tool_format) if node.tools else None
    try:
        constraint = output_constraint(
            fmt,
            [t.spec for t in node.tools],
            node.tool_choice,
            node.parallel_tool_calls,
            node.constraint,
            reasoning,
            in_reasoning,
            node.max_reasoning_tokens,
        )
    except InvalidTools as err:
        raise ProgramError(f"gen({node.name!r}): {err}") from err
    calls_read = fmt if node.tools and node.tool_choice != "none" else None
    return OutputFormat(constraint, reasoning, in_reasoning, calls_read)


def _reasoning_format(node: Gen, backend: Backend) -> Any:
    if not node.reasoning:
        return None
    from runtime.constrain.reasoning import reasoning_format

    name = node.reasoning if isinstance(node.reasoning, str) else backend.reasoning_format
    if name is None:
        raise ProgramError(
            f"gen({node.name!r}, reasoning=True): the backend's model has no reasoning format "
            f"(its chat template shows no <think> block); name one: reasoning='think' (the "
            f"model opens the block) or reasoning='deepseek-r1' (the prompt opens it)"
        )
    return reasoning_format(name)


def appended_ids(result: GenerateResult, backend: Backend) -> list[int]:
    """The token ids the state keeps for `result.text` (exactly what the engine produced)."""
    ids = list(result.output_ids)
    if isinstance(result.matched_stop, str):
        return backend.tokenize(result.text)  # the text was cut inside a token
    if result.matched_stop is not None and ids and ids[-1] == result.matched_stop:
        return ids[:-1]  # the stop token is markup, not content (roles add their own)
    return ids


def gen_meta(result: GenerateResult) -> dict[str, Any]:
    """What `s.meta(name)` reports for a gen."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
        "finish_reason": result.finish_reason,
        "matched_stop": result.matched_stop,
        "rid": result.rid,
        "output_ids": list(result.output_ids),
        "logprobs": result.logprobs,
        "prompt_logprobs": result.prompt_logprobs,  # by position, with their ids, when asked
        "prompt_top_logprobs": result.prompt_top_logprobs,
        "prompt_ids": result.prompt_ids,
        "raw_text": result.text,
    }


def read_output(
    node: Gen, fmt: OutputFormat, result: GenerateResult, meta: dict[str, Any], num_calls: int
) -> Any:
    """The value `s[name]` holds; fills `meta` with the reasoning, content and tool calls.
    `num_calls`: calls the state made before (call ids go on from there)."""
    answer = result.text
    if fmt.reasoning is not None:
        meta["reasoning"], answer = fmt.reasoning.split(result.text, fmt.in_reasoning)
    if fmt.tool_format is None:
        if node.tools:  # tool_choice "none": text only
            meta["content"], meta["tool_calls"] = answer, []
        return parse_output(node, result, answer)
    parsed = fmt.tool_format.parse(answer, [t.spec for t in node.tools])
    # ids numbered in the state, not random: the same run gives the same prompts (and cache)
    wire = [
        ToolCall(id=f"call_{num_calls + i}", name=c.name, arguments=c.arguments)
        for i, c in enumerate(parsed.calls)
    ]
    meta["content"], meta["tool_calls"] = parsed.content, wire
    try:
        calls = calls_from(wire, node.tools)
    except InvalidOutputError as err:
        raise InvalidOutputError(f"gen({node.name!r}) {_ending(node, result)}: {err}") from err
    if not calls and node.tool_choice not in ("auto", "none"):
        raise InvalidOutputError(
            f"gen({node.name!r}, tool_choice={node.tool_choice!r}) {_ending(node, result)} "
            f"after {result.completion_tokens} tokens without a complete tool call; raise "
            f"max_new_tokens; raw text: {result.text!r}"
        )
    return calls or parsed.content


def parse_output(node: Gen, result: GenerateResult, text: str | None = None) -> Any:
    """The value `s[name]` holds: the text (`text`: the answer part of the result's), or what
    a typed gen's parser makes of it."""
    text = result.text if text is None else text
    if node.parse is None:
        return text
    try:
        return node.parse(text)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise InvalidOutputError(
            f"gen({node.name!r}) {_ending(node, result)} after {result.completion_tokens} "
            f"tokens; its text is not a valid {node.parse_label}: {str(err).splitlines()[0]}; "
            f"raw text: {result.text!r}"
        ) from err


def _ending(node: Gen, result: GenerateResult) -> str:
    if result.finish_reason == "length":
        return f"cut by max_new_tokens={node.params.max_new_tokens}"
    return f"ended by {result.finish_reason}"
