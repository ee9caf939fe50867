"""Engine steps while costly grammar masks are being filled (issue 35's last starvation case).

N requests constrained by `( ?[a-z]+){1,12}\\.<i>` (each mask of this regex takes ~0.5-2 s for
xgrammar to fill over SmolLM2's 49k vocabulary) are admitted together with one unconstrained
request; the table gives the engine's step times and when each request finished. Run it
against a source tree with PYTHONPATH:

    PYTHONPATH=/tmp/baseline python examples/benchmarks/grammar_step_bench.py
    python examples/benchmarks/grammar_step_bench.py --num-constrained 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.protocol import Constraint, GenerateRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-constrained", type=int, default=8)
    parser.add_argument("--constrained-tokens", type=int, default=2)
    parser.add_argument("--victim-tokens", type=int, default=16)
    parser.add_argument(
        "--set", action="append", default=[], help="an EngineConfig field: name=value (JSON)"
    )
    args = parser.parse_args()

    step_s: list[tuple[float, float]] = []  # (when it ended, how long it took)
    original = Engine.step

    def timed_step(self) -> bool:
        started = time.perf_counter()
        progressed = original(self)
        if progressed:
            step_s.append((time.perf_counter(), time.perf_counter() - started))
        return progressed

    Engine.step = timed_step  # before the engine binds it to its loop
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    engine = Engine(EngineConfig(max_kv_tokens=4096, **overrides))
    constrained = [
        GenerateRequest(
            text="x",
            sampling=SamplingParams(max_new_tokens=args.constrained_tokens, temperature=0),
            constraint=Constraint(regex=f"( ?[a-z]+){{1,12}}\\.{i}"),
        )
        for i in range(args.num_constrained)
    ]
    victim = GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=args.victim_tokens, temperature=0, ignore_eos=True),
    )
    for request in constrained:  # compiled before the clock starts: the compile is not measured
        engine.intake.grammars.compile(request.constraint)
    begun = time.perf_counter()
    handles = engine.submit_many([*constrained, victim])
    victim_result = handles[-1].result()
    victim_s = time.perf_counter() - begun
    results = [h.result() for h in handles[:-1]]
    all_s = time.perf_counter() - begun
    engine.close()

    durations = [d for _, d in step_s]
    victim_steps = [d for end, d in step_s if end - begun <= victim_s]
    print(f"| {args.num_constrained} constrained + 1 plain request | value |")
    print("| --- | ---: |")
    print(f"| steps | {len(durations)} |")
    print(f"| slowest step (s) | {max(durations):.3f} |")
    print(f"| median step (s) | {statistics.median(durations):.3f} |")
    print(f"| slowest step while the plain request ran (s) | {max(victim_steps):.3f} |")
    print(
        f"| plain request: {victim.sampling.max_new_tokens} tokens done after (s) | "
        f"{victim_s:.2f} |"
    )
    print(f"| constrained requests: all done after (s) | {all_s:.2f} |")
    reasons = sorted({r.finish_reason for r in results})
    print(f"| constrained requests: finish reasons | {', '.join(map(str, reasons))} |")
    assert victim_result.finish_reason == "length", victim_result


if __name__ == "__main__":
    main()
