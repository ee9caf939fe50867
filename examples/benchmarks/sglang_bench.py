"""SGLang programs, only the import changed: flowlang.sglang in-process vs through `flowlang serve`,
and SGLang's own frontend against the same server.

    python examples/benchmarks/sglang_bench.py [--questions 16] [--conversations 8]

Two programs written as SGLang writes them, built from the `sgl` module they are given: its
few-shot QA (a shared k-shot preamble, one question each) and an MT-bench style two-turn chat,
each run with `run_batch(temperature=0)` on the default model, four ways:
  local            flowlang.sglang on LocalBackend: the request graph in-process (batch and fork
                   pins, token ids kept across turns, scoring);
  flowlang http    flowlang.sglang, RuntimeEndpoint(url) of a `flowlang serve` process: the same
                   graph over HTTP;
  sglang api       flowlang.sglang, RuntimeEndpoint(url, api="sglang"): that server used as a
                   plain SGLang endpoint (/generate only: no pins, no scoring API);
  sglang frontend  SGLang's own frontend (pip `sglang`, if installed) against that server: text
                   prompts, re-tokenized by the server at every request (in a subprocess:
                   `import sglang` patches transformers and needs `triton`, stubbed here).
Each row starts from an empty cache; the engine's own counters give the prefill tokens it
computed and its cache hit rate; each row's greedy outputs are compared with the local row's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

import flowlang.sglang as sgl
from flowlang.backends.local import LocalBackend
from runtime.config import EngineConfig
from runtime.engine import Engine

MODEL = "smollm2-135m-instruct"
MAX_KV_TOKENS = 8192  # per engine (~380 MB of KV each): this process's and the server's fit

SHOTS = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
    ("Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("What is the boiling point of water at sea level in Celsius?", "100 degrees"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the largest ocean on Earth?", "The Pacific Ocean"),
    ("How many continents are there?", "Seven"),
]
QUESTIONS = [
    "What is the capital of Japan?",
    "What is the capital of the United Kingdom?",
    "What is the capital city of China?",
    "Who painted the Mona Lisa?",
    "What is the chemical symbol for gold?",
    "How many legs does a spider have?",
    "What is the tallest mountain in the world?",
    "Which language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "Who was the first person to walk on the Moon?",
    "What is the largest planet in the solar system?",
    "What is the currency of Switzerland?",
    "Which gas do plants absorb from the air?",
    "What is the square root of 81?",
    "Who discovered penicillin?",
    "What is the longest river in Africa?",
]
TURNS = [
    ("Write a short travel note about a weekend in Lisbon.", "Now rewrite it for a child."),
    ("Explain what a hash table is.", "Give a one-line example in Python."),
    ("Suggest three names for a bakery.", "Which one is best, and why?"),
    ("Describe how rain forms.", "Summarise that in one sentence."),
    ("List two benefits of walking daily.", "Add one more benefit."),
    ("What makes a good cover letter?", "Write its first sentence for a nurse."),
    ("Explain recursion to a beginner.", "Now explain it with a joke."),
    ("Plan a vegetarian dinner for four.", "Make it cheaper."),
]


def build(sgl: Any) -> tuple[Any, Any]:
    """SGLang's few-shot QA and MT-bench programs, written with `sgl` (sglang or its drop-in)."""

    @sgl.function
    def few_shot_qa(s, question):
        s += "The following are questions with answers.\n\n"
        for q, a in SHOTS:
            s += "Q: " + q + "\nA: " + a + "\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", max_tokens=16, stop="\n")

    @sgl.function
    def answer_mt_bench(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=32))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2", max_tokens=32)

    return few_shot_qa, answer_mt_bench


def run_programs(sgl: Any, backend, num_questions: int, num_conversations: int) -> list:
    """Both programs through run_batch (greedy); their outputs."""
    few_shot_qa, answer_mt_bench = build(sgl)
    qa = few_shot_qa.run_batch(
        [{"question": q} for q in QUESTIONS[:num_questions]],
        temperature=0,
        num_threads=16,
        backend=backend,
    )
    chats = answer_mt_bench.run_batch(
        [{"question_1": a, "question_2": b} for a, b in TURNS[:num_conversations]],
        temperature=0,
        num_threads=16,
        backend=backend,
    )
    return [s["answer"] for s in qa] + [[s["answer_1"], s["answer_2"]] for s in chats]


def measured(name: str, sgl: Any, backend, args) -> tuple[dict, list]:
    """One row: the programs from an empty cache, and what the engine counted meanwhile."""
    run_programs(sgl, backend, 1, 1)  # warm-up: the CPU kernel, the chat template, the client
    sgl.flush_cache(backend)
    before = sgl.get_server_info(backend)["stats"]
    start = time.perf_counter()
    outputs = run_programs(sgl, backend, args.questions, args.conversations)
    wall = time.perf_counter() - start
    after = sgl.get_server_info(backend)["stats"]
    delta = {k: after[k] - before[k] for k in ("prefill_tokens_total", "cached_tokens_total")}
    delta["requests"] = after["requests_finished_total"] - before["requests_finished_total"]
    prompt = delta["prefill_tokens_total"] + delta["cached_tokens_total"]
    delta["hit_rate"] = delta["cached_tokens_total"] / prompt if prompt else 0.0
    return {"name": name, "wall_s": wall, **delta}, outputs


def start_server(port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "flowlang", "serve", "--model", MODEL,
        "--port", str(port), "--max-kv-tokens", str(MAX_KV_TOKENS),
    ]  # fmt: skip
    print("server:", " ".join(command[1:]))
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(1)
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
    server.terminate()
    raise RuntimeError("the server did not start within 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--conversations", type=int, default=len(TURNS))
    parser.add_argument("--frontend", metavar="URL", help=argparse.SUPPRESS)  # the subprocess
    args = parser.parse_args()
    if args.frontend:
        print(json.dumps(frontend_row(args.frontend, args)))
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_server(port)
    url = f"http://127.0.0.1:{port}"
    results = []
    try:
        engine = Engine(EngineConfig(model=MODEL, max_kv_tokens=MAX_KV_TOKENS))
        results.append(measured("local", sgl, LocalBackend(engine), args))
        engine.close()
        for name, api in (("flowlang http", "flowlang"), ("sglang api", "sglang")):
            backend = sgl.RuntimeEndpoint(url, api=api)
            results.append(measured(name, sgl, backend, args))
            backend.close()
        if importlib.util.find_spec("sglang") is not None:
            command = [sys.executable, __file__, "--frontend", url]
            command += [
                "--questions",
                str(args.questions),
                "--conversations",
                str(args.conversations),
            ]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                results.append(tuple(json.loads(done.stdout.splitlines()[-1])))
            else:
                print("the sglang frontend row failed:\n" + done.stderr[-3000:])
    finally:
        server.terminate()
        server.wait(60)
    print_table(*zip(*results, strict=True), args)


def frontend_row(url: str, args) -> tuple[dict, list]:
    """The row of SGLang's own frontend (run in its own process)."""
    if importlib.util.find_spec("triton") is None:
        stub_triton()
    import sglang

    # SGLang picks chat templates by model path and has none for SmolLM2: ChatML is its format
    backend = sglang.RuntimeEndpoint(url, chat_template_name="chatml")
    return measured("sglang frontend", sglang, backend, args)


def stub_triton() -> None:
    """`import sglang` imports triton (GPU kernels) at module level; its frontend never calls
    it. Every `triton...` module becomes one whose attributes are harmless callables."""
    import importlib.abc
    import importlib.machinery
    import types

    class Anything:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __call__(self, *args, **kwargs):
            decorated = len(args) == 1 and callable(args[0]) and not kwargs
            return args[0] if decorated else Anything()

        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything()

    class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            module = types.ModuleType(spec.name)
            module.__path__ = []
            module.__getattr__ = Anything().__getattr__
            return module

        def exec_module(self, module) -> None:
            pass

    sys.meta_path.insert(0, Stub())


def print_table(rows: tuple[dict, ...], outputs: tuple[list, ...], args) -> None:
    print(
        f"\n{args.questions} few-shot QA ({len(SHOTS)} shots) + {args.conversations} two-turn "
        f"chats, {MODEL}, greedy, run_batch; each row from an empty cache\n"
    )
    print(
        "| path | engine requests | prefill computed | cached | cache hit rate | wall s "
        "| outputs as local |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for row, out in zip(rows, outputs, strict=True):
        same = sum(a == b for a, b in zip(out, outputs[0], strict=True))
        print(
            f"| {row['name']} | {row['requests']} | {row['prefill_tokens_total']:,} | "
            f"{row['cached_tokens_total']:,} | {row['hit_rate']:.1%} | {row['wall_s']:.1f} | "
            f"{same}/{len(out)} |"
        )


if __name__ == "__main__":
    main()
