"""`flowlang demo`: the support-agent workload (W1) on the default model, then what the radix
cache did. Registered with the `flowlang` command through the `flowlang.commands` entry point."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import time

from flowlang import InstanceError
from flowlang.backends.local import LocalBackend
from flowlang.cli import Commands, add_command, add_engine_options, engine_config
from programs import support_agent


def register(commands: Commands) -> None:
    """Add the `demo` subcommand."""
    demo = add_command(
        commands,
        "demo",
        "run W1 (support agent) and print a cache report",
        "Run the support-agent workload (W1: user conversations that share a "
        "system prompt and a few-shot block) as one batch on an in-process engine, then "
        "print a few conversations, the top of the radix tree, and what the cache saved.",
    )
    add_engine_options(demo, max_kv_tokens=60_000)
    demo.add_argument(
        "--users", type=int, default=8, help="users (one conversation each), run as one batch"
    )
    demo.add_argument("--turns", type=int, default=2, help="user turns per conversation")
    demo.add_argument("--show", type=int, default=2, help="conversations to print")
    demo.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; 1 if a program failed."""
    from runtime.engine import Engine  # heavy (torch): only when the demo runs

    config = engine_config(model=args.model, max_kv_tokens=args.max_kv_tokens, dtype=args.dtype)
    started = time.perf_counter()
    print(f"[flowlang] starting the engine on {args.model} ...", file=sys.stderr)
    engine = Engine(config)
    load_s = time.perf_counter() - started
    print(engine.summary().render(), file=sys.stderr)
    try:
        inputs = support_agent.make_inputs(engine.tokenizer, "bench")
        users = [
            dataclasses.replace(u, messages=u.messages[: args.turns])
            for u in inputs.users[: args.users]
        ]
        batch = [{"inputs": inputs, "user": u} for u in users]
        backend = LocalBackend(engine, record=True)
        print(
            f"[flowlang] W1 support agent: {len(users)} users x {args.turns} turns "
            f"(engine ready in {load_s:.1f} s)",
            file=sys.stderr,
        )
        run_started = time.perf_counter()
        states = support_agent.support_agent.run_batch(batch, backend=backend)
        wall_s = time.perf_counter() - run_started
        failed = [s for s in states if isinstance(s, InstanceError)]
        for state, user in list(zip(states, users, strict=True))[: args.show]:
            if not isinstance(state, InstanceError):
                _print_conversation(user.name, state.messages()[1:])
        _print_report(engine, backend, wall_s, len(states), failed)
    finally:
        engine.close()
    return 1 if failed else 0


def _print_conversation(name: str, messages: list[dict]) -> None:
    print(f"\n=== {name} ===")
    for message in messages:
        body = textwrap.shorten(message["content"], 300, placeholder=" ...")
        print(textwrap.fill(f"{message['role']:>9}: {body}", 100, subsequent_indent=" " * 11))


def _print_report(engine, backend, wall_s: float, num_programs: int, failed: list) -> None:
    stats = engine.stats()
    report = backend.prompt_report()
    computed = stats["prefill_tokens_total"]
    print("\n=== radix cache (top of the tree) ===")
    print(engine.describe_cache(max_depth=3, max_children=3))
    print("\n=== cache report ===")
    rows = [
        ("programs run", f"{num_programs} ({len(failed)} failed)"),
        ("requests", f"{report['requests']}"),
        ("prompt tokens sent", f"{report['prompt_tokens']:,}"),
        ("unique prompt tokens (union prefix tree)", f"{report['unique_prompt_tokens']:,}"),
        ("lower bound (unique minus KV computed while decoding)", f"{report['lower_bound']:,}"),
        ("prefill tokens computed", f"{computed:,}"),
        ("cache hit rate", f"{stats['cache_hit_rate']:.1%}"),
        ("decode tokens", f"{stats['decode_tokens_total']:,}"),
        ("forward passes", f"{stats['forward_passes_total']:,}"),
        ("peak KV slots in use", f"{stats['kv_slots_peak']:,} of {stats['kv_slots_total']:,}"),
        ("wall time", f"{wall_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for error in failed:
        print(f"\n{error}\n{error.traceback_text}", file=sys.stderr)
