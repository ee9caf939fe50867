"""flowlang: structured LLM programs (gen, select, fork, join, roles, few-shot) run as a request
graph on an engine that prefills every shared prefix once.

Importable without torch: the engine is only imported when a LocalBackend is made.
Tools: `gen(name, tools=[...])` lets the model call them (s[name]: a list of `Call`s, or the
text), `s.run_tools(calls)` runs them and appends the results (flowlang/tools.py).
SGLang programs run unchanged with `import flowlang.sglang as sgl` (see flowlang/sglang/).
"""

from flowlang.backends import MockBackend, get_default_backend, set_default_backend
from flowlang.backends.base import Backend
from flowlang.errors import (
    ExecutionError,
    FlowlangError,
    InstanceError,
    InvalidOutputError,
    ProgramError,
    UnknownVariableError,
)
from flowlang.graph import PrefixReport, RequestGraph
from flowlang.primitives import (
    assistant,
    fewshot,
    gen,
    gen_float,
    gen_int,
    role,
    select,
    system,
    tool_result,
    user,
)
from flowlang.program import Program, program
from flowlang.state import ProgramState
from flowlang.tools import Call, Tool, tool
from runtime.prefix import kv_bytes_per_token_of

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LocalBackend":  # lazy: pulls in the engine's imports
        from flowlang.backends.local import LocalBackend

        return LocalBackend
    if name == "RemoteBackend":
        from flowlang.backends.remote import RemoteBackend

        return RemoteBackend
    raise AttributeError(name)


__all__ = [
    "Backend",
    "Call",
    "ExecutionError",
    "FlowlangError",
    "InstanceError",
    "InvalidOutputError",
    "LocalBackend",
    "RemoteBackend",
    "MockBackend",
    "PrefixReport",
    "Program",
    "ProgramError",
    "ProgramState",
    "RequestGraph",
    "Tool",
    "UnknownVariableError",
    "assistant",
    "fewshot",
    "gen",
    "gen_float",
    "gen_int",
    "get_default_backend",
    "kv_bytes_per_token_of",
    "program",
    "role",
    "select",
    "set_default_backend",
    "system",
    "tool",
    "tool_result",
    "user",
]
