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

from typing import Any

from flowlang.backends import MockBackend, get_default_backend, set_default_backend
from flowlang.backends.base import Backend
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


def separate_reasoning(*args: Any, **kwargs: Any) -> Expr:
    """Not supported: no reasoning parser in flowlang yet."""
    raise NotSupportedError("sgl.separate_reasoning: flowlang has no reasoning parser")


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
