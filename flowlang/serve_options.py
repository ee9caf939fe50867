"""`flowlang serve`'s options, each written once.

The engine's are read off EngineConfig's fields (runtime/config.py): `--field-name`, the field's
type and default, and its description as the help, so a new field is an option with no edit
here (sglang's `add_cli_args_from_dataclass` is the pattern). What a field does not say (choices,
a metavar naming the unit, a parser that refuses a bad number up front) is in `_option_extras`.
The server's and the cluster's options are no EngineConfig fields: they are written out below.

runtime.config is imported inside the functions: a flowlang module imports only torch-free
runtime modules at module level (tests/test_layering.py), and `--help` stays torch-free.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from typing import Any, Protocol

# EngineConfig fields that are no option, each for a reason given beside it
NOT_OPTIONS = (
    # the trace is read in-process (Engine.trace, for runtime/cache/replay.py); a server has no
    # endpoint for it, so it would only grow with every request for as long as it serves
    "record_trace",
)


class Options(Protocol):
    """An argparse parser or argument group: what options are added to."""

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action: ...


def add_engine_fields(
    parser: Options,
    names: Iterable[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> None:
    """One option per EngineConfig field (`names`, else all but NOT_OPTIONS), in field order:
    `--field-name` into `args.field_name`; `defaults` replaces fields' defaults. A bool field
    is a switch: `--name` when it defaults to False, `--name/--no-name` when to True or None."""
    from runtime.config import EngineConfig  # torch-free, like all of `--help`

    fields = EngineConfig.model_fields
    extras = _option_extras()
    for name in names or [n for n in fields if n not in NOT_OPTIONS]:
        field = fields[name]
        extra = dict(extras.get(name, {}))
        default = (defaults or {}).get(name, field.get_default(call_default_factory=True))
        # argparse %-formats help (for its own %(default)s): a description's % is literal
        text = (field.description or "").replace("%", "%%")
        when_none = extra.pop("help_when_none", "")
        option: dict[str, Any] = {"dest": name, "default": default}
        option["help"] = text + (when_none if default is None else "")
        kind = value_type(field.annotation)
        if kind is bool:
            # a switch that is off by default; one on, or decided when unset (None), can be refused
            option["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            option.update(type=kind, metavar="N" if kind is int else None)
        parser.add_argument("--" + name.replace("_", "-"), **(option | extra))


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields among the parsed options, by field name (argparse's dest)."""
    from runtime.config import EngineConfig

    return {name: value for name, value in vars(args).items() if name in EngineConfig.model_fields}


def value_type(annotation: Any) -> Any:
    """The type an option's text parses to: int for `int`, and for `int | None` too."""
    kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
    return kinds[0] if kinds else annotation


def _option_extras() -> dict[str, dict[str, Any]]:
    """Per field, what its type and description leave out: choices (the constants EngineConfig
    checks against), a metavar naming the unit (ints are N unless said here), a parser that
    refuses a number before anything starts, and `help_when_none`: what an unset field means."""
    from runtime.cache.eviction import EVICTION_POLICIES  # torch-free
    from runtime.config import (
        DEVICES,
        DTYPES,
        KV_WRITE_POLICIES,
        QUANTIZE_TYPES,
        SCHEDULE_POLICIES,
        SPECULATIVE_MODES,
        EngineConfig,
    )

    fields = EngineConfig.model_fields
    share = f"{fields['kv_memory_fraction'].default:.0%}".replace("%", "%%")  # argparse's %
    cap_gib = fields["kv_memory_cap_gib"].default
    unsized = f" (default: {share} of available memory, at most {cap_gib:g} GiB)"
    return {
        "dtype": {"choices": DTYPES},
        "device": {"metavar": "{" + ",".join(DEVICES) + "}"},
        "page_size": {"metavar": "TOKENS"},
        "max_kv_tokens": {"metavar": "TOKENS", "help_when_none": unsized},
        "gguf_blocks": {"help_when_none": " (default: on for a GGUF model on such a CPU)"},
        "quantize": {"choices": QUANTIZE_TYPES, "help_when_none": " (default: none)"},
        "kv_memory_fraction": {"metavar": "SHARE"},
        "kv_memory_cap_gib": {"metavar": "GIB"},
        "host_kv_gb": {"metavar": "GIB"},
        "disk_kv_dir": {"metavar": "DIR"},
        "disk_kv_gb": {"type": _positive(float), "metavar": "GIB"},
        "kv_write_policy": {"choices": KV_WRITE_POLICIES},
        "schedule_policy": {"choices": SCHEDULE_POLICIES},
        "eviction_policy": {"choices": tuple(EVICTION_POLICIES)},
        "chunked_prefill_tokens": {"metavar": "TOKENS"},
        "attention_backend": {"metavar": "NAME"},
        "grammar_step_budget_ms": {"metavar": "MS"},
        "speculative": {"choices": SPECULATIVE_MODES},
        "spec_max_draft_tokens": {"type": _positive(int)},
        "reuse_prompt_logits": {"metavar": "ROWS"},
        "tool_call_parser": {"metavar": "FORMAT"},
        "reasoning_parser": {"metavar": "FORMAT"},
    }


def add_listen_options(parser: Options) -> None:
    """Where the server listens and whom it lets in."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=_port, default=30000, help="TCP port to listen on (0: any free one)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require this Bearer key (repeat for several tenants; visible in ps: prefer "
        "--api-key-file or FLOWLANG_API_KEYS) (default: no key, anyone may call)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file with one API key per line (default: none; keys also come from "
        "FLOWLANG_API_KEYS, comma-separated)",
    )
    parser.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="a file with one admin key per line; admin keys may also flush the cache "
        "(default: none; also FLOWLANG_ADMIN_KEYS)",
    )


def add_request_limits(parser: Options) -> None:
    """How much one request may send, how long it, a pin and the shutdown may take, and where
    the Batch API keeps what it was sent."""
    parser.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=8 << 20,
        metavar="BYTES",
        help="largest request body accepted (413 beyond)",
    )
    _add_seconds(
        parser,
        "--pin-lease-seconds",
        30.0,
        help="a pin held over HTTP is released when not renewed within this",
    )
    _add_seconds(
        parser,
        "--head-timeout",
        10.0,
        help="seconds for a request's headers to arrive (408 beyond)",
    )
    _add_seconds(
        parser,
        "--request-timeout",
        None,
        help="abort requests that set no timeout_s after this many seconds (408) "
        "(default: no limit)",
    )
    _add_seconds(
        parser,
        "--drain-timeout",
        10.0,
        help="on SIGTERM or SIGINT: seconds for running requests to finish while new ones get "
        "503; those still running then get a 503 (or a stream's error frame), and it exits 0",
        allow_zero=True,
    )
    parser.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="where /v1/files and /v1/batches keep uploads, batches and their results; an "
        "unfinished batch resumes when a server starts on the same DIR (default: "
        "$FLOWLANG_CACHE_DIR/batches, else ~/.cache/flowlang/batches)",
    )


def _add_seconds(
    parser: Options, flag: str, default_s: float | None, help: str, allow_zero: bool = False
) -> None:
    """A duration option in seconds, refused up front unless above zero (or, `allow_zero`, at
    least zero)."""
    parse = _non_negative(float) if allow_zero else _positive(float)
    parser.add_argument(flag, type=parse, default=default_s, metavar="SECONDS", help=help)


def add_cluster_options(parser: Options) -> None:
    """Replicas of the engine as Ray actors behind a router."""
    from runtime.cluster.policy import POLICIES as ROUTING_POLICIES  # torch-free

    parser.add_argument(
        "--replicas",
        type=_positive(int),
        default=1,
        help="engine replicas as Ray actors behind a router (more than 1 needs flowlang[ray])",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="join this Ray cluster (default: RAY_ADDRESS, else a local Ray)",
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=_positive(float),
        default=1.0,
        metavar="GPUS",
        help="GPUs per replica with --device cuda (0.5: two replicas share one GPU)",
    )
    parser.add_argument(
        "--routing-policy",
        default="cache_aware",
        choices=ROUTING_POLICIES,
        help="how the router picks a replica for each request (with --replicas)",
    )


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
