"""SGLang's frontend language on flowlang: `import flowlang.sglang as sgl` and an SGLang program
runs unchanged, compiled to flowlang's request graph (prefill once, fork and batch pins, the
prefix report) on any flowlang backend.

    >>> import flowlang.sglang as sgl
    >>> @sgl.function
    ... def few_shot_qa(s, question):
    ...     s += "Q: What is the capital of France?\\nA: Paris\\n"
    ...     s += "Q: " + question + "\\nA:" + sgl.gen("answer", stop="\\n", temperature=0)
    >>> sgl.set_default_backend(sgl.MockBackend())
    >>> few_shot_qa.run(question="And of Italy?")["answer"].startswith(" w")
    True
    >>> sgl.set_default_backend(None)

What differs from SGLang, and what is not supported, is listed in docs of each function and in
`tests/test_flowlang_sglang.py`; an argument flowlang cannot honour raises NotSupportedError.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flowlang.backends import MockBackend, get_default_backend, set_default_backend
from flowlang.backends.base import Backend
from flowlang.errors import ProgramError
from flowlang.ir import Gen, Select, Seq
from flowlang.selection import METHODS, ChoicesMethod
from flowlang.sglang.endpoint import RuntimeEndpoint
from flowlang.sglang.expr import (
    Expr,
    NotSupportedError,
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    image,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
    video,
)
from flowlang.sglang.function import FailedState, SglFunction, function
from flowlang.sglang.state import ForkGroup, SGLangState

ProgramState = SGLangState
ProgramStateGroup = ForkGroup
ChoicesSamplingMethod = ChoicesMethod
token_length_normalized = METHODS["token_length_normalized"]
greedy_token_selection = METHODS["greedy_token_selection"]
unconditional_likelihood_normalized = METHODS["unconditional_likelihood_normalized"]


def flush_cache(backend: Backend | None = None) -> bool:
    """Evict every unlocked cached token of the backend's engine."""
    backend = backend or get_default_backend()
    engine = getattr(backend, "engine", None)
    if engine is not None:
        engine.flush_cache()
        return True
    client = getattr(backend, "client", None)
    if client is None:
        return False
    client.post("/flush_cache").raise_for_status()
    return True


def get_server_info(backend: Backend | None = None) -> dict[str, Any] | None:
    """The engine's config and stats (the server's /server_info for a RuntimeEndpoint)."""
    backend = backend or get_default_backend()
    engine = getattr(backend, "engine", None)
    if engine is not None:
        return {"config": engine.config.model_dump(), "stats": engine.stats()}
    client = getattr(backend, "client", None)
    if client is None:
        return None
    response = client.get("/server_info")
    response.raise_for_status()
    return response.json()


def Runtime(*args: Any, **kwargs: Any) -> Backend:  # noqa: N802 - SGLang's name
    """Not supported: start `flowlang serve` and use RuntimeEndpoint(url), or a LocalBackend."""
    raise NotSupportedError(
        "sgl.Runtime launches SGLang's server; run `flowlang serve --model ...` and use "
        "sgl.RuntimeEndpoint(url), or flowlang.LocalBackend(runtime.engine.Engine(...))"
    )


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """SGLang's `separate_reasoning(gen("answer"), model_type="deepseek-r1")`: the gen's
    `<think>` reasoning goes into variable `answer_reasoning_content`, the answer after it into
    `answer`. `model_type`: "deepseek-r1" (the output starts inside the block), "qwen3" or
    "think" (the model opens it), None: the backend's reasoning format.

    Differs from SGLang: the state's text keeps the reasoning as it was decoded (SGLang cuts the
    message back to the answer), so the next request extends the KV the engine already has;
    and a constraint on the gen (regex, json_schema) applies to the answer, not the reasoning.

    >>> expr = separate_reasoning(gen("answer"), model_type="deepseek-r1")
    >>> expr[0].reasoning, expr[0].reasoning_var
    ('deepseek-r1', 'answer_reasoning_content')
    """
    reasoning: bool | str = True
    if model_type is not None:
        from runtime.constrain.reasoning import UnknownReasoningFormat, reasoning_format

        try:
            reasoning = reasoning_format(model_type).name
        except UnknownReasoningFormat as err:
            raise NotSupportedError(
                f"sgl.separate_reasoning(model_type={model_type!r}): {err}"
            ) from err
    if expr is None:
        return Seq()
    items = expr if isinstance(expr, list | tuple) else (expr,)
    nodes = []
    for node in items:
        if isinstance(node, Select):
            raise NotSupportedError(
                f"sgl.separate_reasoning of a select ({node.name!r}): a choice holds no "
                f"reasoning; separate the gen that writes it"
            )
        if isinstance(node, Gen):
            if node.name is None:
                raise ProgramError(
                    "sgl.separate_reasoning needs a named gen (name must be provided)"
                )
            node = dataclasses.replace(
                node, reasoning=reasoning, reasoning_var=f"{node.name}_reasoning_content"
            )
        nodes.append(node)
    return Seq(nodes)


__all__ = [
    "ChoicesSamplingMethod",
    "Expr",
    "FailedState",
    "ForkGroup",
    "MockBackend",
    "NotSupportedError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "SGLangState",
    "SglFunction",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "greedy_token_selection",
    "image",
    "select",
    "separate_reasoning",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "video",
]
