"""Hostile clients against `flowlang serve` built from two source trees (before and after issue
15): per category of case, how many answers were 2xx / 4xx / 5xx, how many hung (no answer in
20 s, or a connection held that long), crashed the server (dead, /health failing, or a greedy
control request answering differently), left work running for nobody (leaks: requests or pins
still there 5 s after their client finished or left), slowed /health past 1 s (stalls), and
how many ended as they should.

    git worktree add /tmp/baseline15 460cfeb
    python examples/benchmarks/hostile_bench.py --tree before=/tmp/baseline15 --tree after=.

Each server runs the default model with a 4,096-token KV pool, its address space capped at
6 GiB (a runaway grammar fails there instead of taking the machine); after a crash or a leak
the server is restarted, so every case starts from a healthy one.

The cases of hostile_cases_tenants.py run against a second server with two tenants' API keys
and an admin key (silent acceptance, tenants, starvation, shutdown), and its replica cases
against a third, `--replicas 2` on Ray (no address-space cap: Ray maps large regions).

`--round4` runs the fourth round's cases instead (issue 50; hostile_round4.py): each attack
measured against a quiet baseline, a table and JSON lines per tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from hostile_cases import CASES, Case, Outcome
from hostile_cases_tenants import CASES as TENANT_CASES
from hostile_cases_tenants import KEYS, REPLICA_CASES

MEMORY_CAP_BYTES = 6 << 30
SETTLE_S = 5.0
CONTROL = {
    "input_ids": [1, 504, 3094, 282, 253, 1167],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
}
COLUMNS = ("cases", "2xx", "4xx", "5xx", "hangs", "crashes", "leaks", "stalls", "as expected")


class ServerProcess:
    """`python -m flowlang serve` from one source tree, restartable."""

    def __init__(
        self,
        tree: str,
        port: int,
        log_path: str,
        tenants: bool = False,
        replicas: int = 0,
        flags: tuple[str, ...] = (),
    ) -> None:
        self.tree, self.port, self.log_path = os.path.abspath(tree), port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.tenants, self.replicas, self.flags = tenants, replicas, tuple(flags)
        self.headers = {"authorization": f"Bearer {KEYS['admin']}"} if tenants else {}

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": self.tree, "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "flowlang", "serve", "--max-kv-tokens", "4096"]
        if self.tenants:
            env["FLOWLANG_API_KEYS"] = f"{KEYS['a']},{KEYS['b']}"
            env["FLOWLANG_ADMIN_KEYS"] = KEYS["admin"]
        if self.replicas:
            command += ["--replicas", str(self.replicas)]
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [*command, *self.flags, "--port", str(self.port)],
                cwd=self.tree,
                env=env,
                stdout=log,
                stderr=log,
                preexec_fn=None if self.replicas else _cap_memory,
                start_new_session=True,
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server from {self.tree} exited: see {self.log_path}")
            if self.health() == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the server from {self.tree} did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)  # its session only: the server and its children
            self.process.wait()

    def health(self, timeout: float = 5.0) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout).status_code
        except httpx.HTTPError:
            return None

    def busy(self) -> bool:
        """Whether requests or pins are still in the engine."""
        info = httpx.get(f"{self.url}/server_info", headers=self.headers, timeout=10)
        stats = info.json()["stats"]
        return bool(stats["num_running"] or stats["num_waiting"] or stats.get("num_pins", 0))


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))


class HealthWatch:
    """/health every 100 ms from a process of its own, as a balancer probes: the cases' client
    threads (40 streams opened at once, say) share this process's GIL, and a probe made here
    would time them too. `take()`: the slowest answer since the last take."""

    def __init__(self, url: str) -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_watch_health, args=(url, child), daemon=True
        )

    def start(self) -> None:
        self._process.start()

    def take(self) -> float:
        """The slowest answer since the last take(), once the probe in flight has ended."""
        self._conn.send("take")
        if not self._conn.poll(25):
            return 25.0  # a probe held that long: a stall
        return self._conn.recv()

    def stop(self) -> None:
        self._process.kill()
        self._process.join()


def _watch_health(url: str, conn) -> None:
    """The watch's process: probe, answer pending takes with the worst since the last one."""
    worst = 0.0
    while True:
        started = time.monotonic()
        try:
            httpx.get(f"{url}/health", timeout=20)  # a new connection each time, as a balancer
        except httpx.HTTPError:
            pass
        worst = max(worst, time.monotonic() - started)
        while conn.poll():
            conn.recv()
            conn.send(worst)
            worst = 0.0
        time.sleep(0.1)


@dataclass
class Verdict:
    outcome: Outcome
    crashed: bool
    leaked: bool
    stalled: bool
    expected: bool


def run_case(server: ServerProcess, watch: HealthWatch, case: Case, control: list) -> Verdict:
    """One case, then the checks; restarts the server after a crash or a leak."""
    watch.take()
    try:
        outcome = case.run(server if case.process else server.url)
    except httpx.TimeoutException:
        outcome = "hang"
    except httpx.TransportError:
        outcome = "closed"
    if case.process:  # it signalled the server: its outcome says how that went; start afresh
        server.stop()
        server.start()
        watch.take()
        return Verdict(outcome, False, False, False, case.is_expected(outcome))
    worst_health_s = watch.take()
    print(f"    slowest /health: {worst_health_s:.2f} s", file=sys.stderr, flush=True)
    stalled = worst_health_s > 1.0
    crashed = server.process.poll() is not None or server.health(10) != 200
    if not crashed:
        crashed = _control(server) != control
    leaked = False
    if not crashed:
        try:
            deadline = time.monotonic() + SETTLE_S
            while server.busy() and time.monotonic() < deadline:
                time.sleep(0.2)
            leaked = server.busy()
        except httpx.HTTPError:  # its stats do not come: as good as dead
            crashed = True
    if crashed or leaked:
        server.stop()
        server.start()
    expected = case.is_expected(outcome) and not (crashed or leaked)
    return Verdict(outcome, crashed, leaked, stalled, expected)


def _control(server: ServerProcess) -> list | None:
    try:
        response = httpx.post(
            f"{server.url}/generate", json=CONTROL, headers=server.headers, timeout=60
        )
    except httpx.HTTPError:
        return None
    return response.json().get("output_ids") if response.status_code == 200 else None


def measure(
    tree: str, port: int, record_path: str, cases: list[Case], **server_kinds
) -> dict[str, Counter]:
    """`cases` against a server from `tree` (`server_kinds`: tenants, replicas): counts per
    category. Each verdict is appended to `record_path` (JSON lines); cases recorded there
    already are not run again (--resume)."""
    records = _records(record_path)
    server = ServerProcess(tree, port, record_path.replace(".jsonl", ".log"), **server_kinds)
    todo = [case for case in cases if case.name not in records]
    if todo:
        server.start()
        watch = HealthWatch(server.url)
        watch.start()
        control = _control(server)
    try:
        for case in todo:
            verdict = run_case(server, watch, case, control)
            records[case.name] = verdict
            with open(record_path, "a") as file:
                file.write(json.dumps({"case": case.name, **dataclasses.asdict(verdict)}) + "\n")
            print(f"  {case.category:10} {case.name:44} {verdict}", file=sys.stderr, flush=True)
    finally:
        if todo:
            watch.stop()
            server.stop()
    return _table(cases, records)


def _records(path: str) -> dict[str, Verdict]:
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        rows = [json.loads(line) for line in file if line.strip()]
    return {row.pop("case"): Verdict(**row) for row in rows}


def _table(cases: list[Case], records: dict[str, Verdict]) -> dict[str, Counter]:
    table: dict[str, Counter] = {}
    for case in cases:
        verdict = records[case.name]
        row = table.setdefault(case.category, Counter())
        row["cases"] += 1
        row[_column(verdict.outcome)] += 1
        row["crashes"] += verdict.crashed
        row["leaks"] += verdict.leaked
        row["stalls"] += verdict.stalled
        row["as expected"] += verdict.expected
    return table


def _column(outcome: Outcome) -> str:
    """The table column of an outcome: "4xx" for "413", "hangs"; "" if none (client left)."""
    if outcome.isdigit():
        return f"{outcome[0]}xx"
    return "hangs" if outcome == "hang" else ""


def print_tables(results: dict[str, dict[str, Counter]], cases: list[Case]) -> None:
    names = list(results)
    print("| category | " + " | ".join(f"{c} ({' / '.join(names)})" for c in COLUMNS) + " |")
    print("| --- |" + " ---: |" * len(COLUMNS))
    categories = list(dict.fromkeys(c.category for c in cases))
    for category in [*categories, "all"]:
        cells = []
        for column in COLUMNS:
            values = []
            for name in names:
                table = results[name]
                rows = table.values() if category == "all" else [table[category]]
                values.append(str(sum(row[column] for row in rows)))
            cells.append(" / ".join(values))
        print(f"| {category} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="name=path, repeatable")
    parser.add_argument("--port", type=int, default=30111)
    parser.add_argument("--category", action="append", help="only these categories")
    parser.add_argument("--case", action="append", help="only the cases of these names")
    parser.add_argument(
        "--resume", action="store_true", help="keep the verdicts recorded by an earlier run"
    )
    parser.add_argument(
        "--round4", action="store_true", help="the fourth round's cases instead (issue 50)"
    )
    parser.add_argument(
        "--round4-jsonl", default="/tmp/hostile_round4_{tree}.jsonl", help="--round4's records"
    )
    args = parser.parse_args()
    if args.round4:
        round4(args)
        return
    suites = {  # suite: its cases, the server they run against
        "plain": (CASES, {}),
        "tenants": (TENANT_CASES, {"tenants": True}),
        "replicas": (REPLICA_CASES, {"tenants": True, "replicas": 2}),
    }
    chosen = {
        suite: [
            c
            for c in cases
            if (not args.category or c.category in args.category)
            and (not args.case or c.name in args.case)
        ]
        for suite, (cases, _) in suites.items()
    }
    results: dict[str, dict[str, Counter]] = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        print(f"{name}: {path}", file=sys.stderr, flush=True)
        results[name] = {}
        for suite, cases in chosen.items():
            if not cases:
                continue
            record_path = f"/tmp/hostile_bench_{name}_{suite}.jsonl"
            if not args.resume and os.path.exists(record_path):
                os.remove(record_path)
            kinds = suites[suite][1]
            results[name].update(measure(path, args.port, record_path, cases, **kinds))
    print_tables(results, [c for cases in chosen.values() for c in cases])


def round4(args: argparse.Namespace) -> None:
    """The fourth round's cases (hostile_round4.py), a table and JSON lines per tree."""
    import hostile_round4

    for spec in args.tree:
        name, _, path = spec.partition("=")
        print(f"{name}: {path}", file=sys.stderr, flush=True)
        log = f"/tmp/hostile_round4_{name}.log"

        def make_server(flags: list[str], path: str = path, log: str = log) -> ServerProcess:
            return ServerProcess(path, args.port, log, tenants=True, flags=tuple(flags))

        records = hostile_round4.run_round4(path, make_server, HealthWatch, args.case, "/tmp")
        hostile_round4.write_jsonl(args.round4_jsonl.format(tree=name), name, records)
        hostile_round4.print_table(name, records)


if __name__ == "__main__":
    main()
