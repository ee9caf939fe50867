"""What a finished gen puts into its state: the tokens appended, the value and its meta."""

from __future__ import annotations

from typing import Any

from flowlang.backends.base import Backend
from flowlang.errors import InvalidOutputError
from flowlang.ir import Gen
from runtime.protocol import GenerateResult


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


def parse_output(node: Gen, result: GenerateResult) -> Any:
    """The value `s[name]` holds: the text, or what a typed gen's parser makes of it."""
    if node.parse is None:
        return result.text
    try:
        return node.parse(result.text)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        cut = (
            f"cut by max_new_tokens={node.params.max_new_tokens}"
            if result.finish_reason == "length"
            else f"ended by {result.finish_reason}"
        )
        raise InvalidOutputError(
            f"gen({node.name!r}) {cut} after {result.completion_tokens} tokens; its text "
            f"is not a valid {node.parse_label}: {str(err).splitlines()[0]}; raw text: "
            f"{result.text!r}"
        ) from err
