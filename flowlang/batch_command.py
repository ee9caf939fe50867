"""`flowlang batch -i in.jsonl -o out.jsonl`: a batch file in the OpenAI Batch API's format run
offline on an in-process engine (vLLM's `run-batch` flags), resumable: results are appended as
each line finishes, and a rerun over the same files skips every line already there.

Lines go to /v1/chat/completions, /v1/completions, or a program registered with `--program`
(`/v1/flowlang/programs/<name>`, its arguments as the body), each through the same route
`flowlang serve` answers it with; the whole file is one batch, its shared prefixes pinned once.
Bad lines and failed requests go to the error file; the rest run. Ctrl-C stops starting lines,
finishes and records the running ones, and exits 130; a rerun picks up from there."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path

from runtime.errors import UsageError

INTERRUPTED_STATUS = 130
PROGRESS_STATS_EVERY_S = 1.0  # the engine's counters are read this often for the bar


def add_batch(commands) -> None:
    from flowlang.cli import add_command
    from flowlang.serve_options import add_engine_fields

    batch = add_command(
        commands,
        "batch",
        "run an OpenAI batch file offline (resumable)",
        __doc__.split("\n\n", 1)[1].replace("\n", " "),
    )
    batch.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    batch.add_argument("-o", "--output-file", required=True, help="results, appended (JSONL)")
    batch.add_argument(
        "--error-file",
        default=None,
        help="errors, appended (JSONL); default: the output file's name with .errors before "
        "its suffix",
    )
    batch.add_argument(
        "--program",
        action="append",
        default=[],
        metavar="MODULE[:NAME]",
        help="a flowlang program lines may run (all of a module's without :NAME); repeatable",
    )
    batch.add_argument("--max-in-flight", type=int, default=64, help="lines running at once")
    batch.add_argument(
        "--min-shared-tokens",
        type=int,
        default=32,
        help="the shortest prefix shared by lines that is pinned for the batch",
    )
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_fields(batch.add_argument_group("engine (EngineConfig, runtime/config.py)"))
    batch.set_defaults(handler=run_batch_file)


def error_file_for(output: Path) -> Path:
    return output.with_name(f"{output.stem}.errors{output.suffix or '.jsonl'}")


def run_batch_file(args: argparse.Namespace) -> int:
    """Load the engine, run the file's lines not yet in the results, print what happened."""
    from flowlang.cli import engine_config
    from flowlang.program_routes import load_programs
    from flowlang.serve_options import engine_settings

    if args.max_in_flight < 1 or args.min_shared_tokens < 1:
        raise UsageError("--max-in-flight and --min-shared-tokens must be at least 1")
    config = engine_config(**engine_settings(args))
    programs = load_programs(args.program)
    source = Path(args.input_file)
    if not source.is_file():
        raise UsageError(f"--input-file {source}: no such file")
    output = Path(args.output_file)
    errors = Path(args.error_file) if args.error_file else error_file_for(output)
    from runtime.engine import Engine

    engine = Engine(config)
    try:
        progress, cancelled = _run(engine, programs, source, output, errors, args)
        done = progress.snapshot()  # reads the engine's counters: before it closes
    finally:
        engine.close()
    print(
        f"[flowlang] batch: {done['completed']} completed, {done['failed']} failed, "
        f"{done['skipped']} already done, {progress.remaining} left, in {done['elapsed_s']:.1f} s; "
        "prefill "
        f"{done['prefill_computed_tokens']:.0f} tokens computed, "
        f"{done['prefill_saved_tokens']:.0f} read from the cache "
        f"({done['prefill_loaded_from_disk_tokens']:.0f} loaded from disk); results in {output}, "
        f"errors in {errors}",
        file=sys.stderr,
    )
    return INTERRUPTED_STATUS if cancelled else 0


def _run(engine, programs, source: Path, output: Path, errors: Path, args):
    from flowlang.program_routes import program_extension
    from runtime.batches.lines import parse_lines
    from runtime.batches.openai_lines import openai_routes
    from runtime.batches.progress import BatchProgress
    from runtime.batches.results_file import ResultsFile
    from runtime.batches.runner import BatchRunner
    from runtime.server.app import create_app

    app = create_app(engine, extensions=[program_extension(programs)])
    routes = {**openai_routes(app, engine), **app.state.line_routes}
    with source.open("rb") as lines:
        parsed = parse_lines(lines, list(routes))
    progress = BatchProgress(stats=engine.stats)
    if not args.no_progress:
        progress.listeners.append(ProgressBar(parsed.total))
    runner = BatchRunner(
        routes,
        pin=engine.pin if engine.caches_prefixes else None,
        max_in_flight=args.max_in_flight,
        min_shared_tokens=args.min_shared_tokens,
        progress=progress,
    )
    with ResultsFile(output) as out, ResultsFile(errors) as err:
        cancelled = asyncio.run(_until_interrupted(runner, parsed, out, err))
    for listener in progress.listeners:
        getattr(listener, "close", lambda: None)()
    return progress, cancelled


async def _until_interrupted(runner, parsed, out, err) -> bool:
    """Run the batch; the first SIGINT stops starting lines (the second one is the default)."""
    cancel = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupted() -> None:
        print("\n[flowlang] batch: finishing the running lines (Ctrl-C again to abandon them)")
        cancel.set()
        loop.remove_signal_handler(signal.SIGINT)

    loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        await runner.run(parsed, out, err, cancel)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    return cancel.is_set()


class ProgressBar:
    """tqdm: lines recorded (those done before counted in), failed and running, the prefill
    tokens read from the cache (the engine's counters, read once a second)."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="batch", unit="line", smoothing=0.1)
        self.stats_read_s = 0.0
        self.saved_tokens = 0.0

    def __call__(self, progress) -> None:
        self.bar.update(progress.skipped + progress.finished - self.bar.n)
        now = time.monotonic()
        if now - self.stats_read_s >= PROGRESS_STATS_EVERY_S:
            self.stats_read_s = now
            self.saved_tokens = progress.prefill_tokens()["cached_tokens"]
        postfix = dict(
            failed=progress.failed, running=progress.running, saved=f"{self.saved_tokens:.0f}"
        )
        self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        self.bar.close()
