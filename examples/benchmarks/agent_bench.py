"""A batch of agent tasks (programs/agent.py: multi-step, three local tools with simulated
latency) on the default model: as one `run_batch` vs the same conversations sent as
independent OpenAI requests (the real `openai` client against `flowlang serve` in this
process), the calls' validity constrained vs unconstrained, and the graph eviction policy vs
lru when the pool is small.

    python examples/benchmarks/agent_bench.py [--tasks 12] [--repeats 3] [--latency-scale 1]
        [--rounds required|auto] [--pressure-kv-tokens 3000] [--skip-pressure]

Table 1 (medians over --repeats, side by side in one run, each on a fresh engine): prefill
tokens computed, token hit rate, wall time, calls made and % valid (parses, names a real
tool, arguments validate against its schema with jsonschema).
Table 2: the first step of every task decoded without the constraint (the tools shown in the
prompt, the output parsed afterwards) vs constrained: how many outputs hold a valid call.
Table 3: run_batch with a pool smaller than the batch's working set, tools sleeping their
declared latency x --latency-scale: prefill computed under lru and graph (which keeps a branch
that waits on a tool for the tool's declared latency).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import uvicorn
from openai import OpenAI

from flowlang.backends.local import LocalBackend
from programs.agent import (
    MAX_STEPS,
    STEP_TOKENS,
    SYSTEM_PROMPT,
    TASKS,
    agent,
    batch_args,
    make_tools,
)
from runtime.config import EngineConfig
from runtime.constrain.tool_calls import tool_format
from runtime.constrain.tool_prompt import openai_tools
from runtime.engine import Engine
from runtime.protocol import GenerateRequest, SamplingParams
from runtime.server.app import ServerSettings, create_app
from runtime.server.chat_turn import plan_chat
from runtime.server.listen import uvicorn_config
from runtime.server.schemas import ChatBody

MODEL = "smollm2-135m-instruct"
KV_TOKENS = 60_000


def engine(**overrides) -> Engine:
    return Engine(EngineConfig(model=MODEL, max_kv_tokens=overrides.pop("max_kv_tokens", KV_TOKENS),
                               **overrides))  # fmt: skip


def valid(name: str, arguments: dict, schemas: dict[str, dict]) -> bool:
    if name not in schemas:
        return False
    try:
        jsonschema.validate(arguments, schemas[name])
    except jsonschema.ValidationError:
        return False
    return True


def counters(e: Engine, before: dict) -> dict:
    after = e.stats()
    computed = after["prefill_tokens_total"] - before["prefill_tokens_total"]
    cached = after["cached_tokens_total"] - before["cached_tokens_total"]
    return {"computed": computed, "hit": cached / (cached + computed) if cached + computed else 0}


# ---------------------------------------------------------------------- run_batch


def run_programs(tasks, latency_scale: float, rounds: str, **engine_overrides) -> dict:
    tools = make_tools(latency_scale=latency_scale)
    schemas = {t.name: t.parameters for t in tools}
    e = engine(**engine_overrides)
    try:
        before, started = e.stats(), time.perf_counter()
        states = agent.run_batch(
            batch_args(tasks, tools=tools, tool_choice=rounds),
            backend=LocalBackend(e),
            progress=False,
        )
        wall = time.perf_counter() - started
        calls = ok = failed = 0
        for state in states:
            if isinstance(state, Exception):
                failed += 1
                continue
            for step in state["steps"]:
                for name, arguments, _ in step:
                    calls += 1
                    ok += valid(name, arguments, schemas)
        return {**counters(e, before), "wall": wall, "calls": calls, "valid": ok, "failed": failed}
    finally:
        e.close()


# ---------------------------------------------------------------------- independent requests


class _Server:
    def __init__(self, e: Engine) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        app = create_app(e, ServerSettings(port=port))
        self.server = uvicorn.Server(uvicorn_config(app, app.state.server.settings,
                                                    log_level="warning"))  # fmt: skip
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def openai_agent(client: OpenAI, task: str, tools, rounds: str, stats: dict) -> None:
    """The agent program's loop, as an OpenAI-API agent writes it."""
    by_name = {t.name: t for t in tools}
    schemas = {t.name: t.parameters for t in tools}
    specs = openai_tools([t.spec for t in tools])
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
    for step in range(MAX_STEPS + 1):
        choice = "required" if step == 0 else rounds if step < MAX_STEPS else "none"
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=specs, tool_choice=choice,
            max_tokens=STEP_TOKENS, temperature=0,
        )  # fmt: skip
        message = reply.choices[0].message
        if not message.tool_calls:
            return
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            stats["calls"] += 1
            stats["valid"] += valid(call.function.name, arguments, schemas)
            try:
                result = json.dumps(by_name[call.function.name](**arguments), default=str)
            except Exception as err:  # noqa: BLE001 - a tool's failure is its result
                result = json.dumps({"error": str(err)})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def run_independent(tasks, latency_scale: float, rounds: str) -> dict:
    tools = make_tools(latency_scale=latency_scale)
    e = engine()
    server = _Server(e)
    try:
        client = OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600)
        stats = {"calls": 0, "valid": 0}
        before, started = e.stats(), time.perf_counter()
        with ThreadPoolExecutor(len(tasks)) as pool:  # as concurrent as run_batch
            list(pool.map(lambda t: openai_agent(client, t, tools, rounds, stats), tasks))
        wall = time.perf_counter() - started
        return {**counters(e, before), "wall": wall, **stats, "failed": 0}
    finally:
        server.stop()  # stops the engine too


# ---------------------------------------------------------------------- validity


def first_step_validity(tasks) -> dict[str, tuple[int, int]]:
    """Per mode, (outputs holding a valid call, outputs) for every task's first step."""
    tools = make_tools()
    schemas = {t.name: t.parameters for t in tools}
    e = engine()
    out = {}
    try:
        fmt = tool_format(e.tool_format)
        specs = [t.spec for t in tools]
        for mode, choice in (("unconstrained", "auto"), ("auto", "auto"), ("required", "required")):
            requests = []
            for task in tasks:
                body = ChatBody(
                    messages=[{"role": "system", "content": SYSTEM_PROMPT},
                              {"role": "user", "content": task}],
                    tools=openai_tools(specs), tool_choice=choice,
                )  # fmt: skip
                plan = plan_chat(e, body)
                requests.append(GenerateRequest(
                    input_ids=plan.prompt_ids,
                    constraint=None if mode == "unconstrained" else plan.constraint,
                    sampling=SamplingParams(max_new_tokens=STEP_TOKENS, temperature=0),
                ))  # fmt: skip
            results = e.generate(requests)
            good = 0
            for r in results:
                parsed = fmt.parse(r.text, specs)
                good += bool(parsed.calls) and all(
                    valid(c.name, json.loads(c.arguments), schemas) for c in parsed.calls
                )
            out[mode] = (good, len(results))
    finally:
        e.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=len(TASKS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-scale", type=float, default=1.0)
    parser.add_argument("--pressure-kv-tokens", type=int, default=3000)
    parser.add_argument("--skip-pressure", action="store_true")
    parser.add_argument(
        "--rounds",
        default="required",
        choices=("required", "auto"),
        help="tool_choice after the first round (required: every task runs every round; the "
        "default model never calls under auto)",
    )
    args = parser.parse_args()
    tasks = (TASKS * (1 + args.tasks // len(TASKS)))[: args.tasks]

    run_programs(tasks[:2], 0.0, args.rounds)  # warm-up: first forwards pack weights, kernels load
    runs: dict[str, list[dict]] = {"run_batch": [], "independent OpenAI requests": []}
    for _ in range(args.repeats):  # alternated, so both see the same machine
        runs["run_batch"].append(run_programs(tasks, args.latency_scale, args.rounds))
        runs["independent OpenAI requests"].append(
            run_independent(tasks, args.latency_scale, args.rounds)
        )
    print(f"\n{len(tasks)} agent tasks, {MAX_STEPS} tool rounds (after the first: "
          f"tool_choice {args.rounds}), default model, greedy; "
          f"medians of {args.repeats}")  # fmt: skip
    print(f"{'':30} {'prefill computed':>17} {'hit rate':>9} {'wall s':>8} {'calls':>6} "
          f"{'valid':>7}")  # fmt: skip
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        valid_pct = 100 * med["valid"] / med["calls"] if med["calls"] else float("nan")
        print(f"{name:30} {med['computed']:>17,.0f} {med['hit']:>8.1%} {med['wall']:>8.1f} "
              f"{med['calls']:>6.0f} {valid_pct:>6.1f}%")  # fmt: skip

    validity = first_step_validity(tasks)
    print("\nfirst step of every task: outputs holding a valid call")
    for mode, (good, total) in validity.items():
        label = {"unconstrained": "unconstrained (parsed after)", "auto": "constrained, auto",
                 "required": "constrained, required"}[mode]  # fmt: skip
        print(f"{label:30} {good:>3} of {total:<3} {100 * good / total:>6.1f}%")

    if not args.skip_pressure:
        print(f"\nrun_batch, pool of {args.pressure_kv_tokens:,} tokens, tools sleeping "
              f"{args.latency_scale:g}x their declared latency")  # fmt: skip
        print(f"{'eviction policy':30} {'prefill computed':>17} {'hit rate':>9} {'wall s':>8}")
        for policy in ("lru", "graph"):
            rs = [
                run_programs(
                    tasks,
                    args.latency_scale,
                    args.rounds,
                    eviction_policy=policy,
                    max_kv_tokens=args.pressure_kv_tokens,
                )  # fmt: skip
                for _ in range(args.repeats)
            ]
            med = {k: statistics.median(r[k] for r in rs) for k in ("computed", "hit", "wall")}
            print(f"{policy:30} {med['computed']:>17,.0f} {med['hit']:>8.1%} "
                  f"{med['wall']:>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
