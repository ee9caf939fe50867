"""What programs write: gen, select, roles, few-shot blocks. Each returns IR nodes; nothing runs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2

from flowlang.errors import ProgramError
from flowlang.ir import Gen, Node, RoleBegin, RoleEnd, Select, Text
from flowlang.selection import METHODS, ChoicesMethod, method_name
from runtime.protocol import Constraint, SamplingParams

INT_REGEX = r"-?(0|[1-9][0-9]{0,17})"
FLOAT_REGEX = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?"


def gen(
    name: str | None = None,
    *,
    regex: str | None = None,
    schema: type | dict | None = None,
    choices: Sequence[str] | None = None,
    grammar: str | None = None,
    next_turn_after_s: float | None = None,
    **sampling: Any,
) -> Gen:
    """Generate into variable `name`; keyword arguments are SamplingParams fields.

    Without a name (SGLang's form) the text is appended to the state but kept in no variable.
    Constrain the text with one of `regex`, `schema` (a pydantic model class: s[name] is then a
    validated instance; or a JSON-schema dict: a parsed dict), `choices` or an EBNF `grammar`.
    `next_turn_after_s`: the program's next request on this state comes about this long after
    this one finishes (a tool call, a user's reply); the engine keeps sooner returns cached.

    >>> gen("answer", max_new_tokens=32, stop="\\n").params.max_new_tokens
    32
    """
    _check_name(name)
    if next_turn_after_s is not None and not next_turn_after_s >= 0:
        raise ProgramError(f"gen({name!r}): next_turn_after_s must be >= 0 seconds")
    try:
        params = SamplingParams(**sampling)
    except ValueError as err:
        raise ProgramError(f"gen({name!r}): {err}") from err
    given = {
        k: v
        for k, v in (
            ("regex", regex),
            ("schema", schema),
            ("choices", choices),
            ("grammar", grammar),
        )
        if v is not None
    }
    if len(given) > 1:
        raise ProgramError(f"gen({name!r}) takes one constraint, got {sorted(given)}")
    if not given:
        return Gen(name, params, next_turn_after_s=next_turn_after_s)
    kind, value = next(iter(given.items()))
    parse, label = None, ""
    if kind == "regex":
        try:
            re.compile(value)
        except re.error as err:
            raise ProgramError(f"gen({name!r}): invalid regex {value!r}: {err}") from err
        constraint = Constraint(regex=value)
    elif kind == "schema":
        constraint, parse, label = _schema_constraint(name, value)
    elif kind == "choices":
        if not value or any(not isinstance(c, str) or not c for c in value):
            raise ProgramError(f"gen({name!r}) choices must be non-empty strings")
        constraint = Constraint(choices=list(value))
    else:
        constraint = Constraint(grammar=value)
    return Gen(name, params, constraint, parse, label, next_turn_after_s)


def gen_int(name: str | None = None, **sampling: Any) -> Gen:
    """Generate an integer; s[name] is an int."""
    node = gen(name, regex=INT_REGEX, **sampling)
    return Gen(node.name, node.params, node.constraint, int, "int", node.next_turn_after_s)


def gen_float(name: str | None = None, **sampling: Any) -> Gen:
    """Generate a decimal number; s[name] is a float."""
    node = gen(name, regex=FLOAT_REGEX, **sampling)
    return Gen(node.name, node.params, node.constraint, float, "float", node.next_turn_after_s)


def _schema_constraint(name: str, schema: Any):
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return (
            Constraint(json_schema=schema.model_json_schema()),
            schema.model_validate_json,
            schema.__name__,
        )
    if isinstance(schema, dict):
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as err:
            raise ProgramError(f"gen({name!r}): the JSON schema is not JSON: {err}") from err
        return Constraint(json_schema=schema), json.loads, "JSON"
    raise ProgramError(
        f"gen({name!r}): schema must be a pydantic model class or a JSON-schema "
        f"dict, got {type(schema).__name__}"
    )


def select(
    name: str | None = None,
    choices: Sequence[str] = (),
    method: str | ChoicesMethod = "token_length_normalized",
) -> Select:
    """Pick one of `choices` by the model's likelihood; the pick goes into variable `name`.

    `method` is a name in flowlang.selection.METHODS or one of its objects.

    >>> select("ok", choices=[" yes", " no"], method="greedy").method
    'greedy'
    """
    _check_name(name)
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise ProgramError(f"select({name!r}) needs a non-empty list of non-empty strings")
    known = method_name(method)
    if known is None:
        raise ProgramError(f"select({name!r}): unknown method {method!r}; use {list(METHODS)}")
    return Select(name, tuple(choices), known)


def system(*content: Any) -> list[Node]:
    return role("system", *content)


def user(*content: Any) -> list[Node]:
    return role("user", *content)


def assistant(*content: Any) -> list[Node]:
    return role("assistant", *content)


def role(name: str, *content: Any) -> list[Node]:
    """A chat message: the model's chat template decides the text around `content`."""
    return [RoleBegin(name), *to_nodes(list(content)), RoleEnd(name)]


def fewshot(template: str, examples: Iterable[Mapping[str, Any]], **context: Any) -> Text:
    """Render a jinja2 few-shot template once over `examples` (as `examples` in the template).

    >>> fewshot("{% for e in examples %}Q: {{ e.q }} A: {{ e.a }}\\n{% endfor %}",
    ...         [{"q": "1+1", "a": "2"}]).text
    'Q: 1+1 A: 2\\n'
    """
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        return Text(env.from_string(template).render(examples=list(examples), **context))
    except jinja2.TemplateError as err:
        raise ProgramError(f"fewshot template: {err}") from err


def to_nodes(value: Any) -> list[Node]:
    """Anything a program may add to a state, as a flat list of IR nodes."""
    if isinstance(value, str):
        return [Text(value)] if value else []
    if isinstance(value, Text | RoleBegin | RoleEnd | Gen | Select):
        return [value]
    if isinstance(value, list | tuple):
        return [node for item in value for node in to_nodes(item)]
    raise ProgramError(
        f"cannot add a {type(value).__name__} to a program state; add str, gen(), select(), "
        f"or a role such as user(...)"
    )


def _check_name(name: str | None) -> None:
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        raise ProgramError(f"a variable name must be an identifier, got {name!r}")
