"""The `flowlang` command: `flowlang serve`, `flowlang models`, plus the subcommands installed
packages register.

A package adds a subcommand through the entry-point group `flowlang.commands`: each entry
point names a `register(commands)` that adds a parser to the argparse subparsers `commands` and
sets its `handler` default to a function of the parsed arguments returning the exit status
(`flowlang demo` comes from `programs.demo` this way).

A handler's `UsageError` (runtime/errors.py: an unknown model, a missing key file, a setting
out of range, a port in use) is printed as `flowlang: error: ...` with exit status 2, like
argparse's own mistakes; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from runtime.errors import UsageError

if TYPE_CHECKING:
    from runtime.config import EngineConfig

COMMANDS_GROUP = "flowlang.commands"
USAGE_ERROR_STATUS = 2  # argparse's status for a bad command line


class Commands(Protocol):
    """The argparse subparsers a plugin's `register(commands)` adds its subcommand to."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default; options defaulting to None say in their help
    what happens then."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; its exit status (2 for a usage mistake,
    printed as one `flowlang: error: ...` line instead of a traceback)."""
    parser = argparse.ArgumentParser(
        prog="flowlang",
        description="Structured LLM programs on a radix-cache engine. "
        "`flowlang COMMAND --help` shows a command's options.",
    )
    commands = parser.add_subparsers(
        dest="command", required=True, title="commands", metavar="COMMAND"
    )
    add_serve(commands)
    add_models(commands)
    add_plugins(commands)
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as err:
        # one write: a line a background thread prints at the same moment stays whole
        sys.stderr.write(f"flowlang: error: {err}\n")
        return USAGE_ERROR_STATUS


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


def add_engine_options(parser: argparse.ArgumentParser, max_kv_tokens: int | None) -> None:
    """--model, --max-kv-tokens, --dtype: what `serve` and `demo` both set of EngineConfig."""
    from runtime.config import DTYPES, EngineConfig  # torch-free, like all of `--help`

    parser.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="a registry name, a local folder or .gguf file, or a Hugging Face hub id "
        "(org/name[@revision]); `flowlang models` lists them",
    )
    fields = EngineConfig.model_fields
    share = f"{fields['kv_memory_fraction'].default:.0%}".replace("%", "%%")  # argparse's %
    memory_default = (
        f" (default: {share} of available memory, at most "
        f"{fields['kv_memory_cap_gib'].default:g} GiB)"
    )
    parser.add_argument(
        "--max-kv-tokens",
        type=int,
        default=max_kv_tokens,
        metavar="TOKENS",
        help="KV pool size in tokens; its GiB are printed at startup, and a CPU pool becomes "
        "resident only as it fills" + (memory_default if max_kv_tokens is None else ""),
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV dtype")


def add_serve(commands: Commands) -> None:
    """`flowlang serve`: the engine over HTTP."""
    from runtime.cache.eviction import EVICTION_POLICIES  # torch-free
    from runtime.cluster.policy import POLICIES as ROUTING_POLICIES
    from runtime.config import DEVICES, KV_WRITE_POLICIES, SCHEDULE_POLICIES, SPECULATIVE_MODES

    serve = commands.add_parser(
        "serve",
        help="serve the engine over HTTP (SGLang and OpenAI APIs)",
        description="Serve one engine (or --replicas engines behind a router) over HTTP: "
        "SGLang's native API, the OpenAI API, flowlang's remote protocol, and a live page at "
        "/dashboard. The port is bound before the model loads.",
        formatter_class=HelpFormatter,
    )
    add_engine_options(serve, max_kv_tokens=None)
    serve.add_argument(
        "--device",
        default="cpu",
        metavar="{" + ",".join(DEVICES) + "}",
        help="where the engine runs (one GPU per engine)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--port", type=_port, default=30000, help="TCP port to listen on (0: any free one)"
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this Bearer key (repeat for several tenants; visible in ps: prefer "
        "--api-key-file or FLOWLANG_API_KEYS) (default: no key, anyone may call)",
    )
    serve.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file with one API key per line (default: none; keys also come from "
        "FLOWLANG_API_KEYS, comma-separated)",
    )
    serve.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="a file with one admin key per line; admin keys may also flush the cache "
        "(default: none; also FLOWLANG_ADMIN_KEYS)",
    )
    serve.add_argument(
        "--schedule-policy",
        default="fcfs",
        choices=SCHEDULE_POLICIES,
        help="the order in which waiting requests are admitted",
    )
    serve.add_argument(
        "--eviction-policy",
        default="lru",
        choices=tuple(EVICTION_POLICIES),
        help="which cached prefixes go first when the KV pool is full",
    )
    serve.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        metavar="GIB",
        help="host memory that KV evicted from the pool moves to, and is loaded back from "
        "instead of computed (L2; default: none)",
    )
    serve.add_argument(
        "--disk-kv-dir",
        default=None,
        metavar="DIR",
        help="a directory of KV chunks below host memory (L3): a restart, or a replica "
        "sharing it, reads what is there (default: none)",
    )
    serve.add_argument(
        "--disk-kv-gb",
        type=_positive(float),
        default=16.0,
        metavar="GIB",
        help="most GiB the disk tier takes",
    )
    serve.add_argument(
        "--kv-write-policy",
        default="write_back",
        choices=KV_WRITE_POLICIES,
        help="write_back: KV moves down a tier when evicted; write_through: every computed "
        "chunk is also copied down at once (to disk too, for replicas sharing it); "
        "write_through_selective: a cached prefix is copied down at its second cache hit",
    )
    serve.add_argument(
        "--speculative",
        default="off",
        choices=SPECULATIVE_MODES,
        help="tree: decoding requests guess their next tokens from the radix tree, their own "
        "context and their program's siblings, verified in one pass; off (the default)",
    )
    serve.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compute every token the same way whatever shares its batch: greedy output "
        "reproducible bit for bit in bf16 too (slower at batch 8 and more)",
    )
    serve.add_argument(
        "--spec-max-draft-tokens",
        type=_positive(int),
        default=8,
        metavar="N",
        help="most tokens one request guesses per step",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=8 << 20,
        metavar="BYTES",
        help="largest request body accepted (413 beyond)",
    )
    serve.add_argument(
        "--pin-lease-seconds",
        type=_positive(float),
        default=30.0,
        metavar="SECONDS",
        help="a pin held over HTTP is released when not renewed within this",
    )
    serve.add_argument(
        "--head-timeout",
        type=_positive(float),
        default=10.0,
        metavar="SECONDS",
        help="seconds for a request's headers to arrive (408 beyond)",
    )
    serve.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=None,
        metavar="SECONDS",
        help="abort requests that set no timeout_s after this many seconds (408) "
        "(default: no limit)",
    )
    serve.add_argument(
        "--drain-timeout",
        type=_non_negative(float),
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT: seconds for running requests to finish while new ones get "
        "503; those still running then get a 503 (or a stream's error frame), and it exits 0",
    )
    serve.add_argument(
        "--replicas",
        type=_positive(int),
        default=1,
        help="engine replicas as Ray actors behind a router (more than 1 needs flowlang[ray])",
    )
    serve.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (default: RAY_ADDRESS, else a local Ray)",
    )
    serve.add_argument(
        "--gpus-per-replica",
        type=_positive(float),
        default=1.0,
        metavar="GPUS",
        help="GPUs per replica with --device cuda (0.5: two replicas share one GPU)",
    )
    serve.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=ROUTING_POLICIES,
        help="how the router picks a replica for each request (with --replicas)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="FORMAT",
        help="how the model writes tool calls: hermes (Qwen, and templates that know no "
        "tools), llama3 or mistral (default: read off the chat template)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="FORMAT",
        help="how the model writes its reasoning: think (<think>...</think>), deepseek-r1 "
        "(the prompt opens the block) or none (default: read off the chat template)",
    )
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted: settings checked and the port bound before the model loads."""
    from runtime.server.listen import bind_socket  # torch-free: a busy port fails in a second

    config = engine_config(
        model=args.model,
        max_kv_tokens=args.max_kv_tokens,
        dtype=args.dtype,
        device=args.device,
        schedule_policy=args.schedule_policy,
        eviction_policy=args.eviction_policy,
        host_kv_gb=args.host_kv_gb,
        disk_kv_dir=args.disk_kv_dir,
        disk_kv_gb=args.disk_kv_gb,
        kv_write_policy=args.kv_write_policy,
        speculative=args.speculative,
        batch_invariant=args.batch_invariant,
        spec_max_draft_tokens=args.spec_max_draft_tokens,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    api_keys = (*args.api_key, *read_keys(args.api_key_file, "FLOWLANG_API_KEYS"))
    admin_keys = read_keys(args.admin_key_file, "FLOWLANG_ADMIN_KEYS")
    sock = bind_socket(args.host, args.port)
    if not args.model.startswith("random:"):
        from runtime.model.registry import check_model_name  # torch-free

        try:
            check_model_name(args.model)  # here, not inside a Ray replica's traceback
        except UsageError:
            sock.close()
            raise
    from runtime.server.app import ServerSettings, serve  # torch, and what serves

    settings = ServerSettings(
        host=args.host,
        port=sock.getsockname()[1],
        api_keys=api_keys,
        admin_keys=admin_keys,
        max_body_bytes=args.max_body_bytes,
        pin_lease_seconds=args.pin_lease_seconds,
        head_timeout_s=args.head_timeout,
        request_timeout_s=args.request_timeout,
        drain_timeout=args.drain_timeout,
    )
    if args.replicas > 1 or args.ray_address:
        from runtime.cluster.cluster import ClusterConfig
        from runtime.cluster.policy import RouterConfig
        from runtime.cluster.serve import serve_cluster

        router = RouterConfig(policy=args.routing_policy)
        cluster = ClusterConfig(
            args.replicas, router, args.ray_address, num_gpus_per_replica=args.gpus_per_replica
        )
        return serve_cluster(config, cluster, settings, sock)
    return serve(config, settings, sock)


def engine_config(**fields: Any) -> EngineConfig:
    """EngineConfig(**fields); a value it refuses is a UsageError naming the option."""
    from runtime.config import EngineConfig

    try:
        return EngineConfig(**fields)
    except ValidationError as err:
        problems = [
            f"--{str(e['loc'][0]).replace('_', '-')}: {e['msg'].removeprefix('Value error, ')}"
            if e["loc"]
            else e["msg"]
            for e in err.errors()
        ]
        raise UsageError("; ".join(problems)) from err


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
        try:
            with open(path, encoding="utf-8") as lines:
                keys += [line.strip() for line in lines]
        except (OSError, UnicodeDecodeError) as err:
            why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
            raise UsageError(f"cannot read the key file {path!r}: {why}") from err
    return tuple(k for k in keys if k)


def _port(text: str) -> int:
    """An argparse type: a TCP port number, 0 to 65535."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


def _positive(kind: type) -> Any:
    """An argparse type: a number of `kind` above zero."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} is not above zero")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def _non_negative(kind: type) -> Any:
    """An argparse type: a number of `kind`, zero or more."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not value >= 0:
            raise argparse.ArgumentTypeError(f"{text} is below zero")
        return value

    parse.__name__ = kind.__name__
    return parse


if __name__ == "__main__":
    sys.exit(main())
