"""The `flowlang` command: `flowlang serve`, `flowlang models`, plus the subcommands installed
packages register.

A package adds a subcommand through the entry-point group `flowlang.commands`: each entry
point names a `register(commands)` that adds a parser to the argparse subparsers `commands` and
sets its `handler` default to a function of the parsed arguments returning the exit status
(`flowlang demo` comes from `programs.demo` this way).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from typing import Any, Protocol

COMMANDS_GROUP = "flowlang.commands"


class Commands(Protocol):
    """The argparse subparsers a plugin's `register(commands)` adds its subcommand to."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; its exit status."""
    parser = argparse.ArgumentParser(
        prog="flowlang", description="Structured LLM programs on a radix-cache engine."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve(commands)
    add_models(commands)
    add_plugins(commands)
    args = parser.parse_args(argv)
    return args.handler(args)


def add_plugins(commands: Commands) -> None:
    """Let every `flowlang.commands` entry point add its subcommand."""
    seen: set[str] = set()
    for entry in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        if entry.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(entry.name)
        try:
            register = entry.load()
        except ImportError as err:  # a broken plugin must not take `flowlang serve` down
            print(f"[flowlang] skipping command {entry.name!r}: {err}", file=sys.stderr)
            continue
        register(commands)


def add_serve(commands: Commands) -> None:
    """`flowlang serve`: the engine over HTTP."""
    serve = commands.add_parser("serve", help="serve the engine over HTTP (SGLang and OpenAI APIs)")
    serve.add_argument("--model", default="smollm2-135m-instruct")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this Bearer key (repeat for several tenants; visible in ps: prefer "
        "--api-key-file or FLOWLANG_API_KEYS)",
    )
    serve.add_argument("--api-key-file", help="a file with one API key per line")
    serve.add_argument(
        "--admin-key-file",
        help="a file with one admin key per line (admin keys may also flush the cache)",
    )
    serve.add_argument("--max-kv-tokens", type=int, default=None)
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    serve.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU per engine)")
    serve.add_argument("--schedule-policy", default="fcfs")
    serve.add_argument("--eviction-policy", default="lru")
    serve.add_argument("--max-body-bytes", type=int, default=8 << 20)
    serve.add_argument("--pin-lease-seconds", type=float, default=30.0)
    serve.add_argument(
        "--head-timeout", type=float, default=10.0, help="seconds for a request's headers"
    )
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort requests that set no timeout_s after this many seconds (408)",
    )
    serve.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas as Ray actors behind a router (needs flowlang[ray])",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (default: RAY_ADDRESS, else local)",
    )
    serve.add_argument(
        "--gpus-per-replica",
        type=float,
        default=1.0,
        help="GPUs per replica with --device cuda (0.5: two replicas share one GPU)",
    )
    serve.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=["round_robin", "least_loaded", "cache_aware", "approximate"],
    )
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    from runtime.config import EngineConfig
    from runtime.server.app import ServerSettings, serve

    config = EngineConfig(
        model=args.model,
        max_kv_tokens=args.max_kv_tokens,
        dtype=args.dtype,
        device=args.device,
        schedule_policy=args.schedule_policy,
        eviction_policy=args.eviction_policy,
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=(*args.api_key, *read_keys(args.api_key_file, "FLOWLANG_API_KEYS")),
        admin_keys=read_keys(args.admin_key_file, "FLOWLANG_ADMIN_KEYS"),
        max_body_bytes=args.max_body_bytes,
        pin_lease_seconds=args.pin_lease_seconds,
        head_timeout_s=args.head_timeout,
        request_timeout_s=args.request_timeout,
    )
    if args.replicas > 1 or args.ray_address:
        from runtime.cluster.cluster import ClusterConfig
        from runtime.cluster.policy import RouterConfig
        from runtime.cluster.serve import serve_cluster

        router = RouterConfig(policy=args.routing_policy)
        cluster = ClusterConfig(
            args.replicas, router, args.ray_address, num_gpus_per_replica=args.gpus_per_replica
        )
        serve_cluster(config, cluster, settings)
    else:
        serve(config, settings)
    return 0


def add_models(commands: Commands) -> None:
    """`flowlang models`: supported architectures, registry names, how hub ids resolve."""
    models = commands.add_parser("models", help="list supported architectures and the registry")
    models.set_defaults(handler=run_models)


def run_models(args: argparse.Namespace) -> int:
    """Print the model table (runtime imported only now, and without torch)."""
    from runtime.model.families import describe_models

    print(describe_models())
    return 0


def read_keys(path: str | None, env_var: str) -> tuple[str, ...]:
    """Keys from a file (one a line) and a comma-separated environment variable."""
    keys = [k.strip() for k in os.environ.get(env_var, "").split(",")]
    if path is not None:
        with open(path, encoding="utf-8") as lines:
            keys += [line.strip() for line in lines]
    return tuple(k for k in keys if k)


if __name__ == "__main__":
    sys.exit(main())
