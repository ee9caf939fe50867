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

from flowlang.batch_command import add_batch
from flowlang.serve_options import (
    add_cluster_options,
    add_engine_fields,
    add_listen_options,
    add_request_limits,
    engine_settings,
)
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
    add_batch(commands)
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
    """--model, --max-kv-tokens, --dtype: the EngineConfig fields `demo` sets (`serve` has
    them all), read off the fields like serve's."""
    add_engine_fields(parser, ("model", "max_kv_tokens", "dtype"), {"max_kv_tokens": max_kv_tokens})


def add_command(
    commands: Commands, name: str, summary: str, description: str
) -> argparse.ArgumentParser:
    """A subcommand's parser: `summary` in `flowlang --help`, `description` in its own, every
    option's default shown (HelpFormatter). Plugins add theirs with it too."""
    return commands.add_parser(
        name, help=summary, description=description, formatter_class=HelpFormatter
    )


def add_serve(commands: Commands) -> None:
    """`flowlang serve`: the engine over HTTP; its options are in flowlang/serve_options.py."""
    serve = add_command(
        commands,
        "serve",
        "serve the engine over HTTP (SGLang and OpenAI APIs)",
        "Serve one engine (or --replicas engines behind a router) over HTTP: "
        "SGLang's native API, the OpenAI API, flowlang's remote protocol, and a live page at "
        "/dashboard. The port is bound before the model loads.",
    )
    add_engine_fields(serve.add_argument_group("engine (EngineConfig, runtime/config.py)"))
    server = serve.add_argument_group("server")
    add_listen_options(server)
    add_request_limits(server)
    add_cluster_options(serve.add_argument_group("replicas (Ray)"))
    serve.add_argument(
        "--program",
        action="append",
        default=[],
        metavar="MODULE[:NAME]",
        help="serve a flowlang program at /v1/flowlang/programs/NAME (all of a module's "
        "without :NAME); repeatable",
    )
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted: settings checked and the port bound before the model loads."""
    from flowlang.program_routes import load_programs, program_extension
    from runtime.server.listen import bind_socket  # torch-free: a busy port fails in a second

    config = engine_config(**engine_settings(args))
    extensions = [program_extension(load_programs(args.program))] if args.program else []
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
        batch_dir=args.batch_dir,
    )
    if args.replicas > 1 or args.ray_address:
        from runtime.cluster.cluster import ClusterConfig
        from runtime.cluster.policy import RouterConfig
        from runtime.cluster.serve import serve_cluster

        router = RouterConfig(policy=args.routing_policy)
        cluster = ClusterConfig(
            args.replicas, router, args.ray_address, num_gpus_per_replica=args.gpus_per_replica
        )
        return serve_cluster(config, cluster, settings, sock, extensions)
    return serve(config, settings, sock, extensions)


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


if __name__ == "__main__":
    sys.exit(main())
