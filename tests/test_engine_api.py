"""The engine's surface stays declared (runtime/engine_api.py): Engine and the router front
ClusterEngine provide every member of EngineAPI, and serving code reads nothing else of its
engine. Checked on the classes and the source alone: no model, no Ray."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

from runtime.cluster.front import ClusterEngine
from runtime.engine import Engine
from runtime.engine_api import EngineAPI

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the code that holds an engine: the server's routes, and a replica (an Engine in a Ray actor)
SERVING = [*sorted((ROOT / "runtime" / "server").glob("*.py")), ROOT / "runtime/cluster/replica.py"]


def _annotations(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


def _protocol_members() -> dict[str, object]:
    """Member name -> its declaration (a function, a property, or None for an attribute)."""
    members: dict[str, object] = dict.fromkeys(EngineAPI.__annotations__)
    for name, value in vars(EngineAPI).items():
        if isinstance(value, property) or inspect.isfunction(value):
            if not name.startswith("_"):
                members[name] = value
    return members


MEMBERS = _protocol_members()


def test_the_protocol_declares_what_serving_uses():
    assert {"config", "arch", "tokenizer", "submit", "score", "pin", "num_slots"} <= set(MEMBERS)
    for name, value in MEMBERS.items():
        target = value.fget if isinstance(value, property) else value
        if target is not None:
            assert inspect.getdoc(target), f"EngineAPI.{name} has no docstring"


@pytest.mark.parametrize("cls", [Engine, ClusterEngine], ids=lambda c: c.__name__)
def test_each_engine_provides_every_member(cls):
    missing, wrong = [], []
    for name, declared in MEMBERS.items():
        if declared is None:  # an attribute: annotated on the class, set by __init__
            if name not in _annotations(cls) and not hasattr(cls, name):
                missing.append(name)
            continue
        found = inspect.getattr_static(cls, name, None)
        if found is None:
            missing.append(name)
        elif isinstance(declared, property) != isinstance(found, property):
            wrong.append(f"{name}: a property in one, not in the other")
        elif inspect.isfunction(declared):
            wrong += _signature_mismatch(name, declared, found)
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert not wrong, wrong


def _signature_mismatch(name: str, declared, found) -> list[str]:
    """The implementation takes the declared parameters, in order, with the same ones
    optional, and needs no others."""
    want = list(inspect.signature(declared).parameters.values())
    have = list(inspect.signature(found).parameters.values())
    if [p.name for p in have[: len(want)]] != [p.name for p in want]:
        return [f"{name}: parameters {[p.name for p in have]}, declared {[p.name for p in want]}"]
    empty = inspect.Parameter.empty
    required = [
        (p.default is empty, q.default is empty)
        for p, q in zip(want, have[: len(want)], strict=True)
    ]
    needs_more = any(q.default is empty for q in have[len(want) :])
    if needs_more or any(want_req != have_req for want_req, have_req in required):
        return [f"{name}: required parameters differ from the declaration"]
    return []


def engine_reads(source: str) -> list[tuple[int, str]]:
    """Every (line, member) read of something named `engine` (a name or an attribute)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and _is_engine(node.args[0])
            and isinstance(node.args[1], ast.Constant)
        ):
            found.append((node.lineno, str(node.args[1].value)))
    return found


def _is_engine(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def test_serving_code_reads_only_protocol_members_of_its_engine():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: engine.{attr}"
        for path in SERVING
        for line, attr in engine_reads(path.read_text())
        if attr not in MEMBERS
    ]
    assert not offenders, "not in runtime/engine_api.py EngineAPI:\n" + "\n".join(offenders)


def test_the_checker_finds_what_it_is_for():
    source = (
        "def f(server, engine):\n"
        "    server.engine.intake.tokens('x', True)\n"
        "    engine.scorer.score(1)\n"
        "    hasattr(engine, 'replica_ids')\n"
        "    return engine.stats(), server.engine.config.model\n"
    )
    reads = [attr for _, attr in engine_reads(source)]
    assert sorted(reads) == ["config", "intake", "replica_ids", "scorer", "stats"]
    assert sorted(a for a in reads if a not in MEMBERS) == ["intake", "replica_ids", "scorer"]
