"""The `flowlang` command explains itself: every option has help and a default, the policies are
listed, the port is bound before the model loads, user mistakes are one `flowlang: error:` line
(exit 2, no traceback), and a started server says what it runs. Run as a user runs it: the real
entry point in a subprocess, offline."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from runtime.cache.eviction import EVICTION_POLICIES
from runtime.cluster.policy import POLICIES as ROUTING_POLICIES
from runtime.config import DTYPES, SCHEDULE_POLICIES

ROOT = pathlib.Path(__file__).resolve().parents[1]
# offline like every test
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def flowlang(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m flowlang ARGS` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "flowlang", *args],
        cwd=ROOT,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_usage_error(
    done: subprocess.CompletedProcess, max_lines: int = 1, engine_started: bool = False
) -> str:
    """Exit status 2 and a short `flowlang: error: ...` message, no traceback; the message.

    Once an engine has started, its kernel-build thread may print its own `[flowlang] ...`
    progress line around the message (even run into it: print writes the newline apart);
    before that, the message is all there is."""
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.replace("flowlang: error: ", "\nflowlang: error: ").split("\n")
    if engine_started:
        lines = [line for line in lines if not line.startswith("[flowlang] ")]
    message = [line for line in lines if line.strip()]
    assert 1 <= len(message) <= max_lines, done.stderr
    assert message[0].startswith("flowlang: error: "), done.stderr
    return "\n".join(message)


def help_entries(text: str) -> dict[str, str]:
    """Each option of an argparse help text -> its whole entry, whitespace collapsed."""
    entries: dict[str, str] = {}
    for chunk in re.split(r"\n(?=  -)", text.split("options:", 1)[1]):
        if words := " ".join(chunk.split()):
            entries[words.split()[0].rstrip(",")] = words
    return entries


def serve_parser() -> argparse.ArgumentParser:
    """`flowlang serve`'s own parser."""
    from flowlang.cli import add_serve

    commands = argparse.ArgumentParser().add_subparsers()
    add_serve(commands)
    return commands.choices["serve"]


def serve_options() -> list[str]:
    """Every option `flowlang serve` defines (read from its parser, not written out here); a
    `--x/--no-x` switch by its first spelling, the one its help entry starts with."""
    return [a.option_strings[0] for a in serve_parser()._actions if a.dest != "help"]


def test_serve_help_shows_every_option_with_its_default_and_every_policy():
    done = flowlang("serve", "--help")
    assert done.returncode == 0, done.stderr
    entries = help_entries(done.stdout)
    options = serve_options()
    assert len(options) >= 19
    for option in options:
        assert option in entries, option
        assert "(default" in entries[option], entries[option]
    for name in (*SCHEDULE_POLICIES, *EVICTION_POLICIES, *ROUTING_POLICIES, *DTYPES, "cuda"):
        assert name in done.stdout, name
    assert f"{{{','.join(SCHEDULE_POLICIES)}}}" in entries["--schedule-policy"]
    assert f"{{{','.join(EVICTION_POLICIES)}}}" in entries["--eviction-policy"]
    assert "(default: 30% of available memory, at most 4 GiB)" in entries["--max-kv-tokens"]


def test_every_engine_config_field_is_a_serve_option_or_excluded():
    from flowlang.serve_options import NOT_OPTIONS
    from runtime.config import EngineConfig

    fields = set(EngineConfig.model_fields)
    options = {a.dest: a.option_strings for a in serve_parser()._actions}
    assert set(NOT_OPTIONS) <= fields, "an exclusion names no field"
    assert len(set(NOT_OPTIONS)) == len(NOT_OPTIONS)
    for name in fields:
        flag = "--" + name.replace("_", "-")
        assert (name in NOT_OPTIONS) != (flag in options.get(name, ())), name


def test_serve_flags_become_engine_config_fields():
    from flowlang.cli import engine_config
    from flowlang.serve_options import engine_settings
    from runtime.config import EngineConfig
    from runtime.errors import UsageError

    def parsed(*argv: str) -> EngineConfig:
        return engine_config(**engine_settings(serve_parser().parse_args(argv)))

    assert parsed("--port", "0", "--replicas", "2") == EngineConfig()  # defaults: the fields'
    config = parsed(
        *("--model", "random:tiny", "--dtype", "bfloat16", "--device", "cuda:1"),
        *("--page-size", "4", "--max-kv-tokens", "4096", "--kv-memory-fraction", "0.5"),
        *("--disk-kv-dir", "/tmp/kv", "--disk-kv-gb", "2.5", "--eviction-policy", "graph"),
        *("--grammar-step-budget-ms", "12.5", "--speculative", "tree"),
        *("--disable-radix-cache", "--batch-invariant", "--no-enable-jump-forward"),
        *("--no-adapt-cpu-threads", "--tool-call-parser", "llama3", "--port", "0"),
    )
    assert config == EngineConfig(
        model="random:tiny",
        dtype="bfloat16",
        device="cuda:1",
        page_size=4,
        max_kv_tokens=4096,
        kv_memory_fraction=0.5,
        disk_kv_dir="/tmp/kv",
        disk_kv_gb=2.5,
        eviction_policy="graph",
        grammar_step_budget_ms=12.5,
        speculative="tree",
        disable_radix_cache=True,
        batch_invariant=True,
        enable_jump_forward=False,
        adapt_cpu_threads=False,
        tool_call_parser="llama3",
    )
    with pytest.raises(UsageError, match="--page-size: Input should be greater than or equal"):
        parsed("--page-size", "0")


def test_help_names_the_commands_and_loads_no_torch():
    code = (
        "import sys\nfrom flowlang.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['demo', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit as done:\n"
        "        assert done.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    top = done.stdout.split("usage: flowlang serve")[0]
    for command in ("serve", "models", "demo"):
        assert re.search(rf"^\s+{command}\s+\w", top, re.M), top
    demo = help_entries(done.stdout.split("usage: flowlang demo")[1])
    for option in ("--model", "--max-kv-tokens", "--dtype", "--users", "--turns", "--show"):
        assert "(default" in demo[option], demo[option]


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        done = flowlang("serve", "--port", str(port))  # the default model, cached
        elapsed_s = time.perf_counter() - started
    message = assert_usage_error(done)
    assert message.startswith(f"flowlang: error: port {port} on 127.0.0.1 is already in use")
    assert "choose another with --port" in message
    assert "[flowlang]" not in done.stderr  # no summary, no kernel build, no model fetch
    assert elapsed_s < 30  # loading the model (and torch) would take longer


def test_the_port_is_checked_before_the_model_name():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = flowlang("serve", "--model", "no-such-model", "--port", str(port))
    assert "already in use" in assert_usage_error(done)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "no-such-model"], "model 'no-such-model' is neither a path"),
        (["--model", "no-such-model", "--replicas", "2"], "model 'no-such-model' is neither"),
        (["--api-key-file", "/no/such/keys"], "cannot read the key file '/no/such/keys'"),
        (["--max-kv-tokens", "3"], "--max-kv-tokens: Input should be greater than or equal"),
        (["--device", "tpu"], "--device: unknown device 'tpu'"),
    ],
)
def test_serve_mistakes_are_one_line(args, expected):
    done = flowlang("serve", "--port", "0", *args)
    message = assert_usage_error(done, engine_started=args[0] == "--model")
    assert expected in message


def test_an_uncached_hub_model_offline_says_how_to_fill_the_cache(tmp_path):
    env = {**ENV, "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = flowlang("serve", "--model", "tiny-org/absent", "--port", "0", env=env)
    message = assert_usage_error(done, max_lines=2, engine_started=True)
    assert "HF_HUB_OFFLINE is set" in message and str(tmp_path / "hub") in message
    assert "`hf download tiny-org/absent --include '*.json'" in message
    assert "huggingface-cli" not in message


def test_demo_mistakes_are_one_line():
    done = flowlang("demo", "--model", "no-such-model")
    message = assert_usage_error(done, engine_started=True)
    assert "flowlang models" in message


def test_serve_prints_what_it_runs_then_serves(tiny_model_dir):
    process = subprocess.Popen(
        [sys.executable, "-m", "flowlang", "serve", "--model", str(tiny_model_dir)]
        + ["--port", "0", "--max-kv-tokens", "20000"],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line.rstrip("\n")) for line in process.stderr], daemon=True
    ).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not (seen and "serving on" in seen[-1]):
            assert process.poll() is None, "\n".join(seen)
            seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
        url = re.search(r"serving on (http://\S+);", seen[-1]).group(1)
        with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
            assert response.status == 200
    finally:
        process.terminate()
        process.wait(30)
    summary = {
        line.split()[1]: line.split(None, 2)[2]
        for line in seen
        if line.startswith("[flowlang] ") and len(line.split()) > 2
    }
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert summary["model"] == str(tiny_model_dir)
    assert summary["family"] == f"llama, {config['num_hidden_layers']} layers"
    assert summary["device"].startswith("cpu, float32, attention backend ")
    pool = next(line for line in seen if "KV pool" in line)
    assert "20,000 tokens" in pool
    shape = [config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")]
    kv_bytes = 2 * 20_000 * math.prod(shape) * 4  # K and V, fp32
    size = float(re.search(r"tokens, ([\d.]+) MiB", pool).group(1))
    assert size == pytest.approx(kv_bytes / 2**20, abs=0.05)
    assert any("set by --max-kv-tokens" in line for line in seen)
    assert summary["kernels"].startswith("native ("), summary["kernels"]  # this machine builds
