"""What one output decodes under, composed of its parts: calls to tools, an answer format
(a response_format) and a reasoning block before them. The OpenAI route and the language both
ask here."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.constrain.reasoning import ReasoningFormat
from runtime.constrain.tool_calls.base import ToolFormat
from runtime.constrain.tool_calls.tags import MAX_WHITESPACE_RUN, after_reasoning
from runtime.protocol import Constraint, ToolSpec


def output_constraint(
    fmt: ToolFormat | None,
    tools: Sequence[ToolSpec],
    choice: str,
    parallel: bool,
    answer: Constraint | None,
    reasoning: ReasoningFormat | None,
    in_reasoning: bool,
    reasoning_budget: int | None = None,
) -> Constraint | None:
    """What one output decodes under: calls to `tools` in `fmt` (choice "none": text that
    starts no call, or `answer`), else `answer`; after the reasoning block when `reasoning` is
    given and something constrains the output. Bad tools are InvalidTools."""
    answer_part = None if answer is None else answer_format(answer)
    if tools:
        tag = fmt.structural_tag(
            tools, choice, parallel, reasoning, in_reasoning, answer_part, reasoning_budget
        )
        return Constraint(structural_tag=tag)
    if reasoning is not None and (answer is not None or reasoning_budget is not None):
        tag = answer_after_reasoning(answer_part, reasoning, in_reasoning, reasoning_budget)
        return Constraint(structural_tag=tag)
    return answer


def answer_after_reasoning(
    answer: dict | None,
    reasoning: ReasoningFormat,
    in_reasoning: bool,
    reasoning_budget: int | None = None,
) -> dict:
    """A structural tag for a reasoning block, then `answer` (an xgrammar format, such as a
    json_schema one; None: free text): a response_format applied after the thinking, not
    inside it. `reasoning_budget`: the most tokens the block may take before it is closed."""
    body = answer if answer is not None else {"type": "any_text", "excludes": [reasoning.begin]}
    return {
        "type": "structural_tag",
        "format": after_reasoning(
            body, reasoning, in_reasoning, answer is not None, reasoning_budget
        ),
    }


def answer_format(constraint: Constraint) -> dict:
    """A constraint as a structural tag's part: the answer after a reasoning block."""
    if constraint.json_schema is not None:
        return {
            "type": "json_schema",
            "json_schema": constraint.json_schema,
            "max_whitespace_cnt": MAX_WHITESPACE_RUN,
        }
    if constraint.regex is not None:
        return {"type": "regex", "pattern": constraint.regex}
    if constraint.choices is not None:
        choices = [{"type": "const_string", "value": c} for c in constraint.choices]
        return {"type": "or", "elements": choices}
    if constraint.grammar is not None:
        return {"type": "grammar", "grammar": constraint.grammar}
    return constraint.structural_tag["format"]
