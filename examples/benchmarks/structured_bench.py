"""Structured generation on the default model: W5 (JSON extraction) at bench size.

    python examples/benchmarks/structured_bench.py [--documents 64]

Reports, with and without jump-forward: wall time, forward passes, decode steps, tokens forced;
the grammar work per generated token (mask fill + apply, matcher accept, forced-token
planning) as a share of the decode step; and grammar compile times (cold and cached).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from flowlang.backends.local import LocalBackend
from programs.json_extraction import TicketInfo, json_extraction, make_inputs
from runtime.config import EngineConfig
from runtime.constrain import grammar as constrained
from runtime.engine import Engine
from runtime.protocol import Constraint

MODEL = "smollm2-135m-instruct"


class Timers:
    def __init__(self) -> None:
        self.grammar_s = 0.0
        self.step_s: list[float] = []


@contextmanager
def instrumented(timers: Timers):
    """Time every grammar call and every engine step (restored afterwards)."""
    patches = [
        (constrained, "apply_constraints"),
        (constrained.ConstraintState, "accept"),
        (constrained.ConstraintState, "forced"),
        (constrained.ConstraintState, "jump_forward"),
    ]
    originals = [getattr(owner, name) for owner, name in patches]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.grammar_s += time.perf_counter() - start

        return wrapper

    step = Engine.step

    def timed_step(self):
        start = time.perf_counter()
        progressed = step(self)
        timers.step_s.append(time.perf_counter() - start)
        return progressed

    for (owner, name), fn in zip(patches, originals, strict=True):
        setattr(owner, name, timed(fn))
    Engine.step = timed_step
    import runtime.model.sampler  # noqa: F401 - imports apply_constraints at call time

    try:
        yield
    finally:
        for (owner, name), fn in zip(patches, originals, strict=True):
            setattr(owner, name, fn)
        Engine.step = step


def run(documents, jump_forward: bool) -> dict:
    timers = Timers()
    with (
        Engine(
            EngineConfig(model=MODEL, max_kv_tokens=60_000, enable_jump_forward=jump_forward)
        ) as engine,
        instrumented(timers),
    ):
        start = time.perf_counter()
        states = json_extraction.run_batch(
            [{"document": d} for d in documents], backend=LocalBackend(engine), progress=False
        )
        wall = time.perf_counter() - start
        stats = engine.stats()
    valid = sum(isinstance(s["ticket"], TicketInfo) for s in states if hasattr(s, "text"))
    generated = stats["decode_tokens_total"] + len(documents)  # + each first token
    return {
        "wall": wall,
        "passes": stats["forward_passes_total"],
        "valid": valid,
        "forced": stats["jump_forward_tokens_total"],
        "generated": generated,
        "grammar_us_per_token": timers.grammar_s / generated * 1e6,
        "grammar_share": timers.grammar_s / sum(timers.step_s),
        "median_step_ms": statistics.median(timers.step_s) * 1e3,
    }


def compile_times(tokenizer_engine: Engine) -> list[tuple[str, float, float]]:
    grammars = tokenizer_engine.intake.grammars
    cases = [
        ("W5 TicketInfo JSON schema", Constraint(json_schema=TicketInfo.model_json_schema())),
        ("phone regex", Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}")),
        ("choices x4", Constraint(choices=["low", "medium", "high", "urgent"])),
        ("EBNF grammar", Constraint(grammar='root ::= "yes" | "no" | "maybe"')),
    ]
    rows = []
    for label, constraint in cases:
        start = time.perf_counter()
        grammars.compile(constraint)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        grammars.compile(constraint)
        rows.append((label, cold * 1e3, (time.perf_counter() - start) * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=64)
    args = parser.parse_args()
    with Engine(EngineConfig(model=MODEL, max_kv_tokens=4096)) as probe:
        documents = make_inputs(probe.tokenizer, "bench")[: args.documents]
        start = time.perf_counter()
        probe.intake.grammars  # noqa: B018 - tokenizer info setup, timed
        setup_ms = (time.perf_counter() - start) * 1e3
        compiles = compile_times(probe)
    results = {jf: run(documents, jf) for jf in (False, True)}
    print(f"\nW5 JSON extraction, {len(documents)} documents, {MODEL}, fp32, greedy\n")
    print(
        "| jump-forward | wall s | forward passes | forced tokens | valid | median step ms "
        "| grammar us/token | grammar share of step time |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for jf, r in results.items():
        print(
            f"| {'on' if jf else 'off'} | {r['wall']:.1f} | {r['passes']} | {r['forced']} | "
            f"{r['valid']}/{len(documents)} | {r['median_step_ms']:.1f} | "
            f"{r['grammar_us_per_token']:.0f} | {r['grammar_share']:.1%} |"
        )
    off, on = results[False], results[True]
    print(
        f"\njump-forward: {off['passes'] - on['passes']} fewer forward passes "
        f"({1 - on['passes'] / off['passes']:.0%}), wall {off['wall'] / on['wall']:.2f}x"
    )
    print(f"\ntokenizer info setup (once per engine): {setup_ms:.0f} ms\n")
    print("| grammar | compile ms (cold) | compile ms (cached) |")
    print("| --- | ---: | ---: |")
    for label, cold, cached in compiles:
        print(f"| {label} | {cold:.1f} | {cached:.3f} |")


if __name__ == "__main__":
    main()
