"""SGLang's primitives on flowlang's IR: `gen`, `select` and roles, with SGLang's arguments.

Each function takes SGLang's argument names and order and returns a flowlang Seq of IR nodes
(`+` concatenates them with text, as in SGLang; `s += expr` appends them). Sampling arguments a gen
does not give stay unset, and the run's defaults (`f.run(temperature=0)`) fill them in.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from flowlang import primitives
from flowlang.errors import ProgramError
from flowlang.ir import Gen, RoleBegin, RoleEnd, Seq
from flowlang.selection import ChoicesMethod
from runtime.protocol import Constraint

# SGLang's regexes for `dtype=` gens: the value stays the text, as SGLang keeps it
INT_REGEX = r"[-+]?[0-9]+[ \n]*"
FLOAT_REGEX = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
BOOL_REGEX = r"(True|False)"
STR_REGEX = r"\"[\w\d\s]*\""
# dtype -> (regex, whether the text also stops at a space or newline, as SGLang's numbers do)
_DTYPES = {
    "int": (INT_REGEX, True),
    "float": (FLOAT_REGEX, True),
    "str": (STR_REGEX, False),
    "bool": (BOOL_REGEX, False),
}


class NotSupportedError(ProgramError):
    """An SGLang feature flowlang cannot honour; the message names it and what to do instead."""


Expr = Seq  # SGLang's expression: text and nodes joined with `+` (flowlang's Seq)


def sampling_fields(args: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling arguments (gen's or run's names) as SamplingParams fields; None means
    unset. `return_text_in_logprobs` is accepted and ignored (logprob entries carry no text)."""
    fields: dict[str, Any] = {}
    renames = {
        "max_tokens": "max_new_tokens",
        "min_tokens": "min_new_tokens",
        "return_logprob": "logprobs",
        "top_logprobs_num": "top_logprobs",
    }
    for key, value in args.items():
        if value is None or key == "return_text_in_logprobs":
            continue
        if key == "n" and value != 1:
            raise NotSupportedError(f"n={value}: one sample per gen; fork the state instead")
        if key == "n":
            continue
        if key == "top_k":
            value = max(0, value)  # SGLang's -1 (no top-k) is our 0
        if key == "logprob_start_len":
            if value < 0:
                continue
            fields["prompt_logprobs"] = True
            value = max(1, value)  # the first token has no logprob
        if key in ("stop", "stop_token_ids", "stop_regex"):
            value = [value] if isinstance(value, str) else list(value)
        fields[renames.get(key, key)] = value
    return fields


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Expr:
    """SGLang's `gen`: generate (into variable `name`); with `choices`, a select."""
    if choices:
        method = choices_method or "token_length_normalized"
        return select(name, choices, temperature or 0.0, method)
    args = dict(locals())
    for key in ("name", "dtype", "choices", "choices_method", "regex", "json_schema"):
        del args[key]
    fields = sampling_fields(args)
    if dtype is not None:
        regex = _dtype_regex(name, dtype, regex, fields)
    node = primitives.gen(name, regex=regex, **fields)
    if json_schema is not None:
        if regex is not None:
            raise ProgramError(f"gen({name!r}) takes one of regex/dtype and json_schema")
        try:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        except ValueError as err:
            raise ProgramError(f"gen({name!r}): json_schema is not JSON: {err}") from err
        node = Gen(node.name, node.params, Constraint(json_schema=schema))
    return Seq([node])


def _dtype_regex(name: str | None, dtype: Any, regex: str | None, fields: dict) -> str:
    key = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    if key not in _DTYPES:
        raise ProgramError(f"gen({name!r}): dtype must be int, float, str or bool, got {dtype!r}")
    if regex is not None:
        warnings.warn(f"gen({name!r}): both dtype and regex given; dtype wins", stacklevel=3)
    dtype_regex, ends_at_space = _DTYPES[key]
    if ends_at_space:
        fields["stop"] = [*fields.get("stop", []), " ", "\n"]
    return dtype_regex


def _typed(dtype: type, name: str) -> Callable[..., Expr]:
    def typed_gen(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
        if "dtype" in kwargs or "min_tokens" in kwargs:
            raise TypeError(f"{typed_gen.__name__}() takes neither dtype nor min_tokens")
        return gen(name, max_tokens, dtype=dtype, **kwargs)

    typed_gen.__name__ = typed_gen.__qualname__ = name
    typed_gen.__doc__ = f"SGLang's `{name}`: `gen(..., dtype={dtype.__name__})`."
    return typed_gen


gen_int = _typed(int, "gen_int")
gen_string = _typed(str, "gen_string")


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str = "token_length_normalized",
) -> Expr:
    """SGLang's `select`: the most likely choice by `choices_method`, into variable `name`."""
    if not choices:
        raise ProgramError(f"select({name!r}) needs choices")
    if temperature > 1e-5:
        raise NotSupportedError(
            f"select({name!r}, temperature={temperature}): choices are picked by likelihood; "
            f"leave temperature at 0"
        )
    if isinstance(choices_method, ChoicesMethod | str):
        return Seq([primitives.select(name, list(choices), choices_method)])
    raise NotSupportedError(
        f"select({name!r}): choices_method must be one of flowlang.sglang's methods "
        f"(token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)"
        f", got {type(choices_method).__name__}"
    )


def role(name: str, expr: Any = None) -> Expr:
    """A `name` message around `expr` (an empty one without it)."""
    if expr is None:
        return Seq([RoleBegin(name), RoleEnd(name)])
    return Seq([RoleBegin(name)]) + expr + RoleEnd(name)


def system(expr: Any = None) -> Expr:
    """A system message."""
    return role("system", expr)


def user(expr: Any = None) -> Expr:
    """A user message."""
    return role("user", expr)


def assistant(expr: Any = None) -> Expr:
    """An assistant message."""
    return role("assistant", expr)


def _role_markers(name: str) -> tuple[Callable[[], Expr], Callable[[], Expr]]:
    """SGLang's `<name>_begin()` and `<name>_end()`: the markers that open and close a `name`
    message, for a message whose text is added between them piece by piece."""

    def begin() -> Expr:
        return Seq([RoleBegin(name)])

    def end() -> Expr:
        return Seq([RoleEnd(name)])

    # named and documented as the module-level functions they become (help(), tracebacks)
    begin.__name__ = begin.__qualname__ = f"{name}_begin"
    end.__name__ = end.__qualname__ = f"{name}_end"
    begin.__doc__ = f"Opens the {name} message (`{name}_end()` closes it)."
    end.__doc__ = f"Closes the {name} message."
    return begin, end


system_begin, system_end = _role_markers("system")
user_begin, user_end = _role_markers("user")
assistant_begin, assistant_end = _role_markers("assistant")


def image(*args: Any, **kwargs: Any) -> Expr:
    """Not supported: our engine runs text models."""
    raise NotSupportedError("sgl.image: flowlang's engine runs text-only models")


def video(*args: Any, **kwargs: Any) -> Expr:
    """Not supported: our engine runs text models."""
    raise NotSupportedError("sgl.video: flowlang's engine runs text-only models")
