"""SGLang's own frontend (`sgl.RuntimeEndpoint`, pip `sglang`) against `flowlang serve` on the
tiny model: every feature program of tests/sglang_programs.py, SGLang's own frontend test
programs, and the endpoint's backend calls, with zero 4xx/5xx responses and no request field
the frontend sent left without effect.

The frontend runs in a subprocess (this file run as a script): `import sglang` patches
transformers process-wide, and its import chain needs `triton` (a GPU package, never installed
here), which the script stubs: the frontend never calls into it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# SGLang's frontend test programs whose assertions hold for any model. Not here: those that
# check answers a random-weight model cannot give, or need images or the OpenAI backend;
# test_gen_min_new_tokens reads `default_backend.endpoint`, which only sgl.Runtime has; and
# test_stream_logprobs races with the server: the server sends each chunk's new output
# logprobs (as SGLang's frontend joins them), but the frontend's reader thread keeps only the
# latest chunk's meta_info, so when two chunks arrive between two reads of its async iterator
# (a fast model) one chunk's logprobs are never seen. Test_sglang_native and
# test_openai_fields check the stream itself, chunk by chunk.
SGLANG_TESTS = {
    "test_mt_bench": {},
    "test_select": {"check_answer": False},
    "test_expert_answer": {"check_answer": False},
    "test_parallel_decoding": {},
    "test_parallel_encoding": {"check_answer": False},
    "test_stream": {},
    "test_regex": {},
    "test_dtype_gen": {},
}


class StatusRecorder:
    """An ASGI wrapper that records (method, path, status) of every response."""

    def __init__(self, app) -> None:
        self.app = app
        self.responses: list[tuple[str, str, int]] = []

    async def __call__(self, scope, receive, send):
        async def record(message):
            if message["type"] == "http.response.start":
                self.responses.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, record)


class FieldLog(logging.Handler):
    """Collects what /generate says about the fields each request sent."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sent: set[str] = set()
        self.unhonoured: set[str] = set()
        self.num_requests = 0

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "fields_sent"):
            self.num_requests += record.levelno == logging.DEBUG
            self.sent.update(record.fields_sent)
            self.unhonoured.update(record.fields_unhonoured)


@pytest.fixture(scope="module")
def frontend_run(tiny_model_dir, tmp_path_factory):
    """Run the frontend script once against a recorded server; its report and the records."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    from conftest import ServerThread

    from runtime.config import EngineConfig
    from runtime.engine import Engine

    recorders: list[StatusRecorder] = []

    def wrap(app):
        recorders.append(StatusRecorder(app))
        return recorders[-1]

    fields = FieldLog()
    logger = logging.getLogger("runtime.server.sglang_api")
    logger.addHandler(fields)
    logger.setLevel(logging.DEBUG)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=6000))
    thread = ServerThread(engine, wrap=wrap)
    out = tmp_path_factory.mktemp("frontend") / "report.json"
    try:
        done = subprocess.run(
            [sys.executable, __file__, thread.url, str(out)],
            capture_output=True,
            text=True,
            timeout=1200,
            cwd=HERE.parent,
        )
        assert done.returncode == 0, done.stderr[-6000:]
        engine.check_integrity()
    finally:
        thread.stop()
        logger.removeHandler(fields)
    return json.loads(out.read_text()), recorders[0].responses, fields


def test_every_response_is_a_success(frontend_run):
    _, responses, _ = frontend_run
    failed = [r for r in responses if r[2] >= 400]
    assert not failed, failed
    paths = {path for _, path, _ in responses}
    assert {"/get_model_info", "/generate", "/concate_and_append_request"} <= paths
    assert {"/flush_cache", "/server_info", "/start_profile", "/stop_profile"} <= paths


def test_no_field_the_frontend_sent_was_dropped(frontend_run):
    _, responses, fields = frontend_run
    assert fields.num_requests == sum(1 for _, path, _ in responses if path == "/generate")
    assert not fields.unhonoured, fields.unhonoured
    # what the frontend sends on every gen: the check saw it (and the schema honours it)
    for name in ("stop_regex", "spaces_between_special_tokens", "skip_special_tokens", "n"):
        assert f"sampling_params.{name}" in fields.sent


def test_sglang_own_frontend_tests_pass(frontend_run):
    report, _, _ = frontend_run
    failed = {name: error for name, error in report["sglang_tests"].items() if error}
    assert not failed, "\n\n".join(f"{n}:\n{e}" for n, e in failed.items())


def test_every_program_runs(frontend_run):
    report, _, _ = frontend_run
    errors = {n: r["error"] for n, r in report["programs"].items() if "error" in r}
    assert not errors, "\n\n".join(f"{n}:\n{e}" for n, e in errors.items())


def test_programs_produce_what_they_ask_for(frontend_run):
    programs = {n: r for n, r in frontend_run[0]["programs"].items() if "error" not in r}
    variables = {n: r.get("variables", {}) for n, r in programs.items()}
    assert programs["multi_turn"]["text"].count("<|im_start|>assistant\n") == 2
    assert len(programs["run_batch"]["states"]) == 3
    assert re.fullmatch(r"((\d{1,3})\.){3}\d{1,3}", variables["regex"]["ip"])
    ticket = json.loads(variables["json_schema"]["ticket"])
    assert set(ticket) == {"urgent", "team", "priority"}
    dtypes = variables["dtypes"]
    int(dtypes["hours"]), int(dtypes["days"]), float(dtypes["pi"])
    assert dtypes["blue"] in ("True", "False") and dtypes["city"].startswith('"')
    for name in ("select_token_length", "select_greedy", "select_unconditional"):
        assert variables[name]["team"] in (" billing", " shipping", " hardware")
    assert variables["gen_choices"]["urgent"] in ("yes", "no")
    assert variables["control_flow"]["action"] in ("Search", "Finish")
    assert len(variables["fork_gather"]["tip"]) == 3
    assert "Statement 1: Noah is the father of Julian." in programs["fork_concatenate"]["text"]
    stream = programs["stream_text"]
    assert stream["streamed"] == stream["text"]
    assert not re.search(r"\d|[A-Z]", variables["stop_rules"]["regex_stop"])
    reasoning = variables["separate_reasoning"]  # a model without <think>: all of it
    assert reasoning["answer"] == "" and reasoning["answer_reasoning_content"]


def test_meta_info_and_logprobs(frontend_run):
    programs = frontend_run[0]["programs"]
    meta = programs["logprobs"]["meta"]["answer"]
    assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) <= 6
    first, *rest = meta["input_token_logprobs"]
    assert first[0] is None and all(lp < 0 for lp, _, _ in rest)  # position 0: no logprob
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    select = programs["select_token_length"]["meta"]["team"]
    assert len(select["normalized_prompt_logprobs"]) == 3
    stream = programs["stream_logprobs"]
    counts = [c["meta"]["completion_tokens"] for c in stream["chunks"]]
    assert len(counts) > 1 and counts == sorted(counts)  # the running meta_info, every chunk
    for chunk in stream["chunks"]:
        assert chunk["text"] and chunk["meta"]["prompt_tokens"] > 0
        assert chunk["meta"]["output_token_logprobs_length"] == chunk["meta"]["completion_tokens"]
    # each chunk: the logprobs of the tokens new since the frame before it (the frontend keeps
    # the latest frame's meta_info: those of a frame read late are lost, and a frame that only
    # releases held-back text or says the request finished has none)
    seen = 0
    for chunk in stream["chunks"]:
        meta = chunk["meta"]
        assert len(meta["output_token_logprobs"]) <= meta["completion_tokens"] - seen
        seen = meta["completion_tokens"]
    assert sum(len(c["meta"]["output_token_logprobs"]) for c in stream["chunks"]) > 0
    assert "".join(c["text"] for c in stream["chunks"]) == stream["variables"]["answer"]


# ---------------------------------------------------------------- the frontend, as a script
def _stub_triton() -> None:
    """sglang imports triton at module level for GPU kernels the frontend never runs."""
    import importlib.abc
    import importlib.machinery
    import types

    class Anything:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else Anything()

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


def _frontend_report(url: str) -> dict:
    """Run every program, SGLang's own tests and the backend calls; errors as text."""
    import sglang as sgl
    import sglang.test.test_programs as sglang_tests

    sys.path.insert(0, str(HERE))
    import sglang_programs

    # SGLang's frontend picks templates by model path and has no SmolLM2 rule: name it
    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    sgl.set_default_backend(backend)
    report: dict = {"model_path": backend.get_model_name(), "programs": {}, "sglang_tests": {}}
    backend.start_profile()
    for name, program in sglang_programs.build(sgl).items():
        try:
            report["programs"][name] = sglang_programs.run(program)
        except Exception:  # noqa: BLE001 - reported, and the test names the program
            report["programs"][name] = {"error": traceback.format_exc()}
    for name, kwargs in SGLANG_TESTS.items():
        try:
            getattr(sglang_tests, name)(**kwargs)
            report["sglang_tests"][name] = None
        except Exception:  # noqa: BLE001 - reported, and the test names it
            report["sglang_tests"][name] = traceback.format_exc()
    backend.stop_profile()
    backend.cache_prefix("A prefix the next requests share. " * 4)
    report["server_info"] = sgl.get_server_info()
    sgl.flush_cache()
    return report


if __name__ == "__main__":
    if importlib.util.find_spec("triton") is None:
        _stub_triton()
    Path(sys.argv[2]).write_text(json.dumps(_frontend_report(sys.argv[1]), default=str))
