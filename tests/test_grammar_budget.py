"""Grammar compilation is bounded in memory and time: a trial compile in a child process with
a capped address space, killed past its budget; compiled grammars over a size cap are refused
and the cache keeps the most recently used within its byte budget."""

from __future__ import annotations

import pytest

from runtime.constrain import grammar as constrained
from runtime.constrain.grammar import GrammarCache, InvalidConstraintError, check_nesting
from runtime.constrain.probe import GrammarProbe
from runtime.protocol import Constraint


def many_states(n: int) -> Constraint:
    """A regex of ~13n bytes whose compiled size grows about as n squared (10 MiB at 300,
    60 MiB at 1,500)."""
    return Constraint(regex="(" + "|".join(f"(a|b)*c{{{i}}}" for i in range(1, n)) + ")")


@pytest.fixture(scope="module")
def grammars(default_tokenizer):
    cache = GrammarCache(default_tokenizer, 49152, (2,))
    yield cache
    cache.probe.close()


@pytest.fixture(autouse=True)
def patient(monkeypatch):
    """A generous time budget: these tests are about memory, on a machine that may be busy."""
    monkeypatch.setattr(constrained, "COMPILE_BUDGET_S", 120.0)


@pytest.fixture
def small_probe(grammars):
    probe = GrammarProbe(grammars.info.serialize_json(), 8 << 20)
    yield probe
    probe.close()


def test_a_trial_past_its_memory_limit_says_memory_and_the_next_one_works(small_probe):
    assert small_probe.trial(many_states(1000), 120).outcome == "memory"
    verdict = small_probe.trial(Constraint(regex="[a-z]+"), 120)
    assert verdict.outcome == "ok" and 0 < verdict.num_bytes < 1 << 20


def test_a_trial_past_its_time_budget_is_killed(grammars):
    probe = GrammarProbe(grammars.info.serialize_json(), 512 << 20)
    try:
        probe.start()
        child = probe._child
        assert probe.trial(many_states(1000), 0.05).outcome == "time"
        assert child.poll() is not None  # killed: no compile keeps running in the background
        assert probe.trial(Constraint(regex="[a-z]+"), 120).outcome == "ok"
    finally:
        probe.close()


def test_an_invalid_regex_names_the_problem(grammars):
    with pytest.raises(InvalidConstraintError, match="invalid regex: .*parenthesis"):
        grammars.compile(Constraint(regex="(((a"))


def test_a_grammar_too_large_to_keep_is_refused(grammars, monkeypatch):
    monkeypatch.setattr(constrained, "MAX_COMPILED_BYTES", 4 << 20)
    with pytest.raises(InvalidConstraintError, match=r"takes 9\.\d MiB; the limit is 4 MiB"):
        grammars.compile(many_states(300))


def test_a_grammar_past_the_memory_budget_is_refused(grammars, monkeypatch):
    monkeypatch.setattr(grammars, "probe", GrammarProbe(grammars.info.serialize_json(), 8 << 20))
    try:
        with pytest.raises(InvalidConstraintError, match="needs over 8 MiB of memory"):
            grammars.compile(many_states(1000))
    finally:
        grammars.probe.close()


def test_the_cache_keeps_the_most_recently_used_within_its_budget(grammars, monkeypatch):
    small = [Constraint(regex=f"[a-z]{{{n}}}x") for n in (3, 4, 5)]
    sizes = [grammars.compile(c).memory_size_bytes for c in small]
    monkeypatch.setattr(constrained, "MAX_CACHED_BYTES", 2 * max(sizes) + 1024)
    grammars.compile(small[1])  # most recently used: kept
    grammars.compile(Constraint(regex="[a-z]{6}x"))
    keys = list(grammars._compiled[None])
    assert len(keys) == 2 and '"regex": "[a-z]{4}x"' in keys[0]


def nested(depth: int) -> Constraint:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return Constraint(json_schema=schema)


def test_a_schema_nested_past_the_cap_is_refused_before_anything_recurses():
    check_nesting(nested(constrained.MAX_SCHEMA_DEPTH))
    with pytest.raises(InvalidConstraintError, match="nests deeper than 64 levels"):
        check_nesting(nested(constrained.MAX_SCHEMA_DEPTH + 1))
