"""What clients that are not flowlang programs say about the program a request belongs to,
mapped onto the GraphHints the scheduler and eviction read, as a flowlang program's requests
carry them. The one place the HTTP forms are read; docs/serving.md has the table.

The forms, as the ecosystem sends them:
- NVIDIA Dynamo's `nvext.agent_hints` (priority, strict_priority, osl, speculative_prefill) and
  `nvext.agent_context` (session_type_id, session_id, trajectory_id, parent_trajectory_id), with
  its headers X-Dynamo-Session-ID, X-Dynamo-Parent-Session-ID, X-Dynamo-Session-Final and
  X-Dynamo-Request-Priority (X-Dynamo-Request-Strict-Priority is refused, as strict_priority);
- OpenCode's X-Session-ID / X-Parent-Session-ID (Dynamo reads them as its own);
- SGLang's `session_id` ("stable identity shared by requests in the same session") and
  `priority`, vLLM's and our OpenAI routes' `priority`;
- flowlang's own `hints` (GraphHints, as /v1/flowlang/generate takes them).

One policy input may come from several of them: they must agree (the same value), else the
request is a 400 naming each source and its value, since picking one would drop the other
without a word. Ids are qualified by the caller's tenant (the API key's tag), as cache
namespaces are, so two tenants that use the same session id are two programs.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.errors import InvalidRequestError
from runtime.protocol import MAX_HINT_FUTURE_TOKENS, MAX_NAMESPACE_CHARS, GraphHints
from runtime.server.errors import invalid_input
from runtime.server.state import Server

log = logging.getLogger("flowlang.server")

# headers that name the request's session (its program) and the session that spawned it
SESSION_HEADERS = ("x-dynamo-session-id", "x-session-id")
PARENT_SESSION_HEADERS = ("x-dynamo-parent-session-id", "x-parent-session-id")
SESSION_FINAL_HEADER = "x-dynamo-session-final"
PRIORITY_HEADER = "x-dynamo-request-priority"
STRICT_PRIORITY_HEADER = "x-dynamo-request-strict-priority"

_NO_TIERS = (
    "queue tiers that always precede lower ones are not supported here (one priority "
    "orders the queue and the cache: send priority, higher first)"
)
_IDS = ("program_id", "fork_group_id")  # compared across requests: qualified by tenant


class _Nested(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AgentHints(_Nested):
    """Dynamo's nvext.agent_hints."""

    priority: int | None = Field(None, description="higher runs first, as Dynamo's API layer")
    strict_priority: int | None = Field(None, ge=0, description="refused unless 0 (unset)")
    osl: int | None = Field(None, ge=0, le=MAX_HINT_FUTURE_TOKENS)
    speculative_prefill: bool | None = None


class AgentContext(_Nested):
    """Dynamo's nvext.agent_context: who the request is, within an agent run."""

    session_type_id: str | None = Field(None, description="a workload class: trace metadata")
    session_id: str | None = None
    trajectory_id: str | None = None
    parent_trajectory_id: str | None = None


class NvExt(_Nested):
    """The part of Dynamo's `nvext` request extension that says what a request's program is;
    its other fields (sampling, routing, annotations) are refused by name."""

    agent_hints: AgentHints | None = None
    agent_context: AgentContext | None = None


class _Claims:
    """For each GraphHints field, every source that set it: one field, one value."""

    def __init__(self) -> None:
        self.by_field: dict[str, list[tuple[str, Any]]] = defaultdict(list)

    def add(self, field: str, source: str, value: Any) -> None:
        if value is not None and value != "":
            self.by_field[field].append((source, value))

    def resolve(self) -> dict[str, Any]:
        """Each claimed field's value; sources that disagree are a 400 naming them."""
        values = {}
        for field, claims in self.by_field.items():
            if len({repr(v) for _, v in claims}) > 1:
                given = ", ".join(f"{source}={value!r}" for source, value in claims)
                raise InvalidRequestError(
                    f"{given} disagree (each sets the request's {field}): send one of them, "
                    "or the same value in each"
                )
            values[field] = claims[0][1]
        return values


def graph_hints(server: Server, request: Request, body: BaseModel) -> GraphHints:
    """The GraphHints of `body` (an OpenAI or SGLang request body: its `priority`,
    `session_id`, `hints` and, on the OpenAI routes, `nvext`) and `request`'s headers."""
    claims = _Claims()
    if "priority" in body.model_fields_set:  # OpenAI's defaults to 0: unsent is no claim
        claims.add("priority", "priority", getattr(body, "priority", None))
    claims.add("program_id", "session_id", getattr(body, "session_id", None))
    nvext = getattr(body, "nvext", None)
    if nvext is not None:
        _claim_nvext(claims, parse_nvext(nvext))
    _claim_headers(claims, request)
    hints: GraphHints | None = getattr(body, "hints", None)
    if hints is not None:
        for field in hints.model_fields_set:
            claims.add(field, f"hints.{field}", getattr(hints, field))
    values = claims.resolve()
    for field in _IDS:
        if field in values:
            values[field] = _qualified(server, request, field, values[field], claims)
    with invalid_input():
        return GraphHints(**values)


def tenant_hints(server: Server, request: Request, hints: GraphHints) -> GraphHints:
    """flowlang's own hints (/v1/flowlang) with their ids under the caller's tenant, as the
    other routes' are: fork groups are gathered by id alone when the queue is ordered."""
    claims = _Claims()
    for field in _IDS:
        claims.add(field, f"hints.{field}", getattr(hints, field))
    update = {f: _qualified(server, request, f, v, claims) for f, v in claims.resolve().items()}
    return hints.model_copy(update=update) if update else hints


def run_priority(request: Request) -> int:
    """The priority of a flowlang program run over HTTP (POST /v1/flowlang/programs/NAME, its
    body the program's arguments): X-Dynamo-Request-Priority, higher first, 0 without it. The
    run is a program of its own, its requests carry its ids: a header naming a session, its
    parent or its last request is refused by name, not dropped."""
    claims = _Claims()
    _claim_headers(claims, request)
    values = claims.resolve()
    for field in sorted(set(values) - {"priority"}):
        sources = ", ".join(source for source, _ in claims.by_field[field])
        raise InvalidRequestError(
            f"{sources}: a program run is a program of its own (its requests carry its "
            f"ids); of these headers it takes {PRIORITY_HEADER} only"
        )
    return values.get("priority", 0)


def parse_nvext(nvext: dict[str, Any]) -> NvExt:
    """`nvext` as the fields this server takes; another field, or a value out of range, is a
    400 naming it (nvext.<field>...)."""
    try:
        parsed = NvExt.model_validate(nvext)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(["nvext", *(str(part) for part in first["loc"])])
        if first["type"] == "extra_forbidden":
            raise InvalidRequestError(
                f"{where}: not supported (this server takes nvext.agent_hints: priority, osl, "
                "speculative_prefill; and nvext.agent_context: session_id, trajectory_id, "
                "parent_trajectory_id, session_type_id)"
            ) from err
        raise InvalidRequestError(f"{where}: {first['msg']}") from err
    hints = parsed.agent_hints
    if hints is not None and hints.strict_priority:
        raise InvalidRequestError(f"nvext.agent_hints.strict_priority: {_NO_TIERS}")
    context = parsed.agent_context
    if context is not None and context.session_type_id:
        # Dynamo records it in traces and nothing else; no policy here reads a workload class
        log.warning(
            "fields with no effect here: nvext.agent_context.session_type_id (trace metadata)"
        )
    return parsed


def _claim_nvext(claims: _Claims, nvext: NvExt) -> None:
    hints = nvext.agent_hints
    if hints is not None:
        where = "nvext.agent_hints"
        claims.add("priority", f"{where}.priority", hints.priority)
        claims.add("expected_output_tokens", f"{where}.osl", hints.osl)
        # "prefill the predicted next turn": the program extends this sequence next, so the
        # engine keeps this turn's KV as the next turn's start instead of recomputing it
        prefill = hints.speculative_prefill or None  # false: no claim either way
        claims.add("continuation", f"{where}.speculative_prefill", prefill)
    context = nvext.agent_context
    if context is not None:
        where = "nvext.agent_context"
        claims.add("program_id", f"{where}.session_id", context.session_id)
        claims.add("branch_id", f"{where}.trajectory_id", context.trajectory_id)
        # subagents spawned by one trajectory are siblings: a fork group, scheduled together
        claims.add("fork_group_id", f"{where}.parent_trajectory_id", context.parent_trajectory_id)


def _claim_headers(claims: _Claims, request: Request) -> None:
    headers = request.headers
    for name in SESSION_HEADERS:
        for value in headers.getlist(name):
            claims.add("program_id", name, value.strip())
    for name in PARENT_SESSION_HEADERS:
        for value in headers.getlist(name):
            claims.add("fork_group_id", name, value.strip())
    for value in headers.getlist(PRIORITY_HEADER):
        claims.add("priority", PRIORITY_HEADER, _header_int(PRIORITY_HEADER, value))
    for value in headers.getlist(STRICT_PRIORITY_HEADER):
        if _header_int(STRICT_PRIORITY_HEADER, value):
            raise InvalidRequestError(f"{STRICT_PRIORITY_HEADER}: {_NO_TIERS}")
    for value in headers.getlist(SESSION_FINAL_HEADER):
        # the session's last request: nothing of the program extends this sequence after it
        if _header_bool(SESSION_FINAL_HEADER, value):
            claims.add("continuation", SESSION_FINAL_HEADER, False)


def _header_int(name: str, value: str) -> int:
    try:
        return int(value.strip())
    except ValueError as err:
        raise InvalidRequestError(f"header {name} must be an integer, got {value!r}") from err


def _header_bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise InvalidRequestError(f"header {name} must be true or false, got {value!r}")
    return text in ("true", "1")


def _qualified(server: Server, request: Request, field: str, value: str, claims: _Claims) -> str:
    """`value` (a client's id) under the caller's tenant, as cache namespaces are: the same
    session id from two API keys names two programs."""
    qualified = server.namespace(request, value)
    if len(qualified) > MAX_NAMESPACE_CHARS:
        sources = ", ".join(source for source, _ in claims.by_field[field])
        raise InvalidRequestError(
            f"{sources}: at most {MAX_NAMESPACE_CHARS - (len(qualified) - len(value))} "
            f"characters, got {len(value)}"
        )
    return qualified
