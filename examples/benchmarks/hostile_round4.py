"""hostile_bench.py --round4: the fourth round's cases (hostile_cases_round4.py, its _answers
and _disk files) against servers from one source tree, one server variant at a time, each
with a quiet row (tenant B's probe and /health with no attack) measured first. A table per
tree (case, what was measured, the quiet baseline, goal met?) and JSON lines."""

from __future__ import annotations

import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostile_cases_round4 import (
    LEAK_TOLERANCE_MB,
    LEAKS,
    PROBE_CAP_S,
    PROBE_EVERY_S,
    QUIET_FLOOR_S,
    STALLS,
    Round4Case,
    Target,
    victim_once,
)
from hostile_cases_round4_answers import ANSWERS
from hostile_cases_round4_disk import DISK_CASES, OWN_CASES

# leaks first on each server: memory other cases freed would hide what a leak takes
CASES = [*LEAKS, *STALLS, *ANSWERS, *DISK_CASES, *OWN_CASES]
# a small host tier: its own growth (it fills lazily) is capped, so a leak shows (#10)
VARIANT_FLAGS = [
    "--eviction-policy",
    "graph",
    "--reasoning-parser",
    "think",
    "--host-kv-gb",
    "0.05",
]
HEALTH_CAP_S = 20.0  # the health watch's probe gives up here
SETTLE_S = 90.0


def server_flags(variant: str, work_dir: str) -> list[str]:
    if variant == "variants":
        return VARIANT_FLAGS
    if variant == "disk":
        disk = Path(work_dir) / "round4_disk"
        shutil.rmtree(disk, ignore_errors=True)
        return ["--disk-kv-dir", str(disk), "--kv-write-policy", "write_through"]
    return []


def run_round4(
    tree: str,
    make_server: Callable[[list[str]], Any],
    make_watch: Callable[[str], Any],
    names: list[str] | None,
    work_dir: str,
) -> list[dict]:
    """Every chosen case against servers from `tree` (`make_server(flags)`: a stopped
    ServerProcess; `make_watch(url)`: a HealthWatch): one record per case and quiet row."""
    chosen = [c for c in CASES if not names or c.name in names]
    records: list[dict] = []
    for variant in ("tenants", "variants", "disk"):
        cases = [c for c in chosen if c.server == variant]
        if cases:
            records += _on_server(variant, cases, tree, make_server, make_watch, work_dir)
    own = [c for c in chosen if c.server == "own"]
    if own:

        def launch(flags: list[str]) -> Any:
            server = make_server(flags)
            server.start()
            return server

        target = Target("", 0, lambda: 0.0, launch, work_dir=work_dir, tree=tree)
        records += [_record(c, _run(c, target), {}) for c in own]
    return records


def _on_server(variant, cases, tree, make_server, make_watch, work_dir) -> list[dict]:
    flags = server_flags(variant, work_dir)
    server = make_server(flags)
    server.start()
    watch = make_watch(server.url)
    watch.start()
    try:
        quiet = _quiet(server.url, watch)
        print(f"  [{variant}] quiet: {quiet}", file=sys.stderr, flush=True)
        records = [{"server": variant, "case": "quiet", "kind": "quiet", "metrics": quiet}]
        for case in cases:
            target = Target(
                server.url,
                server.process.pid,
                watch.take,
                None,
                disk_dir=flags[1] if variant == "disk" else "",
                work_dir=work_dir,
                tree=tree,
            )
            records.append(_record(case, _run(case, target), quiet))
            _settle(server, watch)
        return records
    finally:
        watch.stop()
        server.stop()


def _quiet(url: str, watch: Any) -> dict:
    watch.take()
    worst = 0.0
    for _ in range(8):
        worst = max(worst, victim_once(url))
        time.sleep(PROBE_EVERY_S)
    return {"victim_s": worst, "health_s": watch.take()}


def _run(case: Round4Case, target: Target) -> dict:
    print(f"  {case.finding:5} {case.name} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        metrics = case.run(target)
    except Exception as err:  # noqa: BLE001 - a case that breaks is reported, the run goes on
        traceback.print_exc()
        metrics = {"outcome": f"the case failed: {err!r}"[:120], "expected": False}
    metrics["case_s"] = round(time.monotonic() - started, 1)
    print(f"        {metrics}", file=sys.stderr, flush=True)
    return metrics


def _settle(server: Any, watch: Any) -> None:
    """Wait until tenant B is answered quickly and nothing runs; else start afresh."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        try:
            alive = server.process.poll() is None
            if alive and victim_once(server.url) < 2.0 and not server.busy():
                watch.take()
                return
        except Exception:  # noqa: BLE001 - its stats do not come: as good as stuck
            pass
        time.sleep(1.0)
    print("        (still busy: restarting the server)", file=sys.stderr, flush=True)
    server.stop()
    server.start()
    watch.take()


def _record(case: Round4Case, metrics: dict, quiet: dict) -> dict:
    summary, quiet_text, met = judge(case, metrics, quiet)
    return {
        "server": case.server,
        "finding": case.finding,
        "case": case.name,
        "kind": case.kind,
        "metrics": metrics,
        "quiet": quiet,
        "summary": summary,
        "quiet_summary": quiet_text,
        "goal_met": met,
    }


def judge(case: Round4Case, m: dict, quiet: dict) -> tuple[str, str, bool]:
    """(what was measured, the quiet baseline, goal met?) of one case's metrics."""
    parts, met, quiet_text = [], True, "-"
    if "victim_s" in m:
        limit = 2 * max(quiet.get("victim_s", 0.0), QUIET_FLOOR_S)
        parts.append(f"B {_seconds(m['victim_s'], PROBE_CAP_S)}, /health {_seconds(m['health_s'])}")
        met = m["victim_s"] <= limit and m["health_s"] <= 1.0
        quiet_text = f"B {quiet['victim_s']:.2f} s, /health {quiet['health_s']:.2f} s"
    if "rss_flushed_mb" in m:
        grew = m["rss_flushed_mb"] - m["rss_before_mb"]
        parts.append(
            f"RSS +{m['rss_after_mb'] - m['rss_before_mb']:.0f} MB, +{grew:.0f} MB after flush "
            f"({m.get('ok', '?')}/{m.get('requests', '?')} ok)"
        )
        met = grew <= LEAK_TOLERANCE_MB
        quiet_text = f"RSS {m['rss_before_mb']:.0f} MB"
    if "peak_after_mb" in m:
        grew = m["peak_after_mb"] - m["peak_before_mb"]
        parts.append(f"{m['status']}, peak RSS +{grew:.0f} MB")
        met = 400 <= m["status"] < 500 and grew <= 100
        quiet_text = f"peak RSS {m['peak_before_mb']:.0f} MB"
    if "outcome" in m:
        parts.append(str(m["outcome"]))
        met = met and bool(m["expected"])
    return "; ".join(parts), quiet_text, met


def _seconds(value: float, cap: float = HEALTH_CAP_S) -> str:
    return f"> {cap:.0f} s" if value >= cap - 0.01 else f"{value:.2f} s"


def print_table(name: str, records: list[dict], out=sys.stdout) -> None:
    print(f"\n### {name}\n", file=out)
    print("| # | case | measured | quiet baseline | goal met |", file=out)
    print("| --- | --- | --- | --- | --- |", file=out)
    for r in records:
        if r["case"] == "quiet":
            q = r["metrics"]
            line = f"B {q['victim_s']:.2f} s, /health {q['health_s']:.2f} s"
            print(f"| | quiet ({r['server']}) | {line} | | |", file=out)
            continue
        met = "yes" if r["goal_met"] else "**no**"
        print(
            f"| {r['finding']} | {r['case']} | {r['summary']} | {r['quiet_summary']} | {met} |",
            file=out,
        )


def write_jsonl(path: str, name: str, records: list[dict]) -> None:
    with open(path, "w") as file:
        for record in records:
            file.write(json.dumps({"tree": name, **record}) + "\n")
