"""What a token tree of guesses could add over the one linear guess speculation verifies.

    python examples/benchmarks/spec_tree_potential.py [--dtype float32] [--batches 1 8]

Runs spec_bench's workloads with `speculative="tree"` and, at every step a request guessed,
records the guess taken and every guess the sources held (its own context, each running
sibling, each matching tree position: `Drafter.candidates`). After the run each guess is
scored against the tokens the request really produced (greedy): the tokens the taken guess got
accepted, and what the best of all guesses would have got at the same depth (a token tree of
every guess, verification free: an upper bound on what tree verification adds) and up to 8
deep (what longer guesses would add). And over every decode step, guessing or not: the tokens
some source held right (up to 8 ahead), so the most that copying can save: the ceiling
tokens / (tokens - copyable) is the speed-up if verifying cost nothing and every copyable
token saved a pass (per request: a fork's passes wait for its slowest branch). One engine, one
process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import spec_bench  # noqa: E402

from programs import tree_of_thought  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.scheduler.drafts import Drafter  # noqa: E402

DEEP = 8  # tokens of every guess recorded


def accepted(req, position: int, guess) -> int:
    """Leading tokens of `guess` that `req` really produced from `position` on."""
    actual = req.tokens(position, min(position + len(guess), req.num_tokens))
    n = 0
    while n < len(actual) and actual[n] == guess[n]:
        n += 1
    return n


class Recorder:
    """Wraps Drafter.draft: (request, position, guess taken, every guess) per decode step."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self._draft = Drafter.draft
        recorder = self

        def draft(drafter, req, running, num_decodes=1):
            running = list(running)
            taken = recorder._draft(drafter, req, running, num_decodes)
            every = drafter.candidates(req, running, DEEP)
            recorder.steps.append((req, req.num_tokens, list(taken), every))
            return taken

        Drafter.draft = draft

    def row(self, name: str, batch: int) -> dict:
        taken = same_depth = deep = rescued = missed = guessing = tokens = 0
        firsts = []
        covered: set[tuple[int, int]] = set()  # (request, position) some source held right
        for req, pos, guess, every in self.steps:
            got = accepted(req, pos, guess)
            tokens += 1 + got
            best = max([got] + [accepted(req, pos, g) for g in every])
            covered.update((id(req), pos + i) for i in range(best))
            if not guess:
                continue
            guessing += 1
            taken += got
            same_depth += max([got] + [accepted(req, pos, g[: len(guess)]) for g in every])
            deep += max([got] + [accepted(req, pos, g) for g in every])
            firsts.append(len({g[0] for g in every} | {guess[0]}))
            missed += got == 0
            rescued += got == 0 and any(accepted(req, pos, g) for g in every)
        return {
            "workload": name,
            "batch": batch,
            "steps": guessing,
            "decode_steps": len(self.steps),
            "copyable": len(covered),
            "ceiling": tokens / max(1, tokens - len(covered)),
            "taken": taken,
            "same_depth": same_depth,
            "deep": deep,
            "first_tokens": statistics.mean(firsts) if firsts else 0.0,
            "missed": missed,
            "rescued": rescued,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    args = parser.parse_args()
    recorder = Recorder()
    rows = []
    for batch in args.batches:
        config = EngineConfig(
            dtype=args.dtype, max_kv_tokens=spec_bench.KV_TOKENS, speculative="tree"
        )
        with Engine(config) as engine:
            workloads = spec_bench.request_workloads(engine.tokenizer, max(batch, 3))
            questions = tree_of_thought.make_inputs(engine.tokenizer, "bench")
            for name in ("w1", "w5", "rag", "fork"):
                recorder.steps.clear()
                if name == "fork":
                    spec_bench.fork_cell(engine, questions[:batch])
                else:
                    reqs = workloads[name]
                    groups = [[r] for r in reqs[:3]] if batch == 1 else [reqs[:batch]]
                    spec_bench.decode_cell(engine, groups)
                rows.append(recorder.row(name, batch))
                print(f"  {name} B={batch}: {rows[-1]}", file=sys.stderr, flush=True)

    def gain(row, key):
        return f"{row[key]} ({(row[key] / row['taken'] - 1) * 100:+.0f}%)" if row["taken"] else "-"

    print(f"\n{args.dtype}; accepted guessed tokens over the steps that guessed:\n")
    print(
        "| workload | batch | guessing steps | taken guess | best guess, same depth | "
        f"best guess, up to {DEEP} deep | distinct first tokens | missed / another had one |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['workload']} | {r['batch']} | {r['steps']} | {r['taken']} | "
            f"{gain(r, 'same_depth')} | {gain(r, 'deep')} | {r['first_tokens']:.1f} | "
            f"{r['missed']} / {r['rescued']} |"
        )
    print("\nEvery decode step, guessing or not: the most copying can save\n")
    print("| workload | batch | decode steps | copyable tokens | ceiling (verification free) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        # a fork's branches copy each other, but the program waits for the branch ahead,
        # which has nothing to copy: a per-request ceiling says nothing about its wall time
        ceiling = "-" if r["workload"] == "fork" else f"{r['ceiling']:.2f}x"
        print(
            f"| {r['workload']} | {r['batch']} | {r['decode_steps']} | {r['copyable']} | "
            f"{ceiling} |"
        )


if __name__ == "__main__":
    main()
