"""A program's spans (OpenTelemetry): the run, its steps (gen, select, join, a fork's pin, tool
calls) and fork branches; the engine's request spans nest under the steps that sent them.

The run's span is current on the body's thread; a state's worker thread gets its parent
explicitly (a branch's span, or the run's), since threads do not inherit the current context.
Off (runtime/telemetry.py decides), every span here is the null one.

    flowlang.program <name>                  the run
      flowlang.gen <var> / flowlang.select <var> / flowlang.join
        text_completion <model>              the engine's request (runtime/telemetry.py)
      flowlang.branch <id>                   a fork's branch (its steps nest under it)
      execute_tool <tool>                    a tool call (s.run_tools, s.fork_tools)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from runtime.protocol import GenerateRequest, GenerateResult
from runtime.telemetry import result_attributes, tracer

if TYPE_CHECKING:
    from flowlang.backends.base import Backend
    from flowlang.context import RunContext


def model_of(backend: Backend) -> str | None:
    """The model a backend runs (None for a backend that does not say: a mock)."""
    return getattr(backend, "model_name", None)


def program_span(name: str, ctx: RunContext) -> Any:
    """A run's span, child of this thread's current context (a calling program's run)."""
    return tracer().start_span(
        f"flowlang.program {name}",
        None,
        {
            "flowlang.program.name": name,
            "flowlang.program.id": ctx.program_id,
            "gen_ai.request.model": model_of(ctx.backend),
        },
    )


def step_span(parent: Any, kind: str, name: str | None, branch_id: str) -> Any:
    """A step's span (`kind`: gen, select, join, pin) under `parent` (its state's span); `with`
    it: it is current while the step runs, so the engine's request span nests under it."""
    return tracer().start_span(
        f"flowlang.{kind} {name}" if name else f"flowlang.{kind}",
        parent.context,
        {"flowlang.step.kind": kind, "flowlang.step.name": name, "flowlang.branch.id": branch_id},
        kind="client" if kind in ("gen", "select", "pin") else "internal",
    )


def pin_span(num_prefix_tokens: int) -> Any:
    """A fork's shared prefix pinned (prefilled once), under this thread's current span (the
    step of the first branch request that reads it); `with` it."""
    return tracer().start_span(
        "flowlang.pin", None, {"flowlang.pin.prefix_tokens": num_prefix_tokens}, kind="client"
    )


def branch_span(parent: Any, branch_id: str, fork_id: str, num_branches: int) -> Any:
    """A fork branch's span under its parent state's, ended when the branch closes."""
    return tracer().start_span(
        f"flowlang.branch {branch_id}",
        parent.context,
        {
            "flowlang.branch.id": branch_id,
            "flowlang.fork.id": fork_id,
            "flowlang.fork.num_branches": num_branches,
        },
    )


def gen_request_attributes(request: GenerateRequest, backend: Backend) -> dict[str, Any]:
    """What a gen asks, as GenAI attributes."""
    params = request.sampling
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.request.model": model_of(backend),
        "gen_ai.request.max_tokens": params.max_new_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "flowlang.constraint": None if request.constraint is None else request.constraint.kind,
    }


def gen_result_attributes(result: GenerateResult) -> dict[str, Any]:
    """What a gen got: tokens in (computed, cached), out, why it stopped; the engine's id."""
    return result_attributes(result)


def select_attributes(num_choices: int, chosen: int) -> dict[str, Any]:
    """A select's choices and the one it took."""
    return {"flowlang.select.num_choices": num_choices, "flowlang.select.chosen_index": chosen}


def tool_span(tool_name: str, call_id: str, parent: Any) -> Any:
    """A tool call's span (GenAI's execute_tool) under `parent`, a context taken on the thread
    that asked for the calls (they run on a pool's threads); `with` it."""
    return tracer().start_span(
        f"execute_tool {tool_name}",
        parent,
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool_name,
            "gen_ai.tool.call.id": call_id,
        },
    )
