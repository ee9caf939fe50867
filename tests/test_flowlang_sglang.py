"""flowlang.sglang: SGLang programs, only the import changed, on MockBackend (each mapped
feature), and on the tiny model in-process vs through `flowlang serve` (identical greedy
outputs)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading

import pytest
from sglang_programs import build, run

import flowlang as fl
import flowlang.sglang as sgl
from flowlang import MockBackend
from flowlang.selection import METHODS
from flowlang.sglang import NotSupportedError


@pytest.fixture
def mock():
    backend = MockBackend(choice_logprobs={"True": -0.1, " yes": -0.2, " no": -3.0})
    sgl.set_default_backend(backend)
    yield backend
    sgl.set_default_backend(None)


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\n"
    s += "A: Paris\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0)


@sgl.function
def answer_mt_bench(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1"))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2")


def test_string_concatenation_and_run_level_sampling(mock):
    state = few_shot_qa.run(question="And of Italy?", max_new_tokens=3)
    (request,) = mock.requests
    assert request.sampling.temperature == 0 and request.sampling.stop == ["\n"]
    assert request.sampling.max_new_tokens == 3  # the run's default, the gen sets none
    assert state.text().endswith("Q: And of Italy?\nA:" + state["answer"])
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] == 3
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    expr = "A:" + sgl.gen("x") + "\n"
    assert [type(n).__name__ for n in expr] == ["Text", "Gen", "Text"]
    with pytest.raises(TypeError, match="unsupported operand"):
        sgl.gen("x") + 3


def test_same_requests_as_the_native_program(mock):
    @fl.program
    def native(s, question_1, question_2):
        s += fl.system("You are a helpful assistant.")
        s += fl.user(question_1)
        s += fl.assistant(fl.gen("answer_1", temperature=0.7, max_new_tokens=16))
        with s.user():
            s += question_2
        with s.assistant():
            s += fl.gen("answer_2", temperature=0.7, max_new_tokens=16)

    args = {"question_1": "Plan a trip.", "question_2": "Shorter."}
    ours = answer_mt_bench.run(**args, temperature=0.7, max_new_tokens=16)
    theirs = native.run(**args)
    first, second = mock.requests[:2], mock.requests[2:]
    assert [r.input_ids for r in first] == [r.input_ids for r in second]
    assert [r.sampling for r in first] == [r.sampling for r in second]
    assert ours.messages() == theirs.messages() and len(ours.messages()) == 5


def test_roles_begin_end_and_expression_forms(mock):
    @sgl.function
    def chat(s):
        s += sgl.system_begin() + "Be brief." + sgl.system_end()
        s += sgl.user_begin()
        s += "Hi"
        s += sgl.user_end()
        s.assistant("Hello" + sgl.gen("greeting", max_tokens=2))
        s += sgl.user()  # an empty message, as SGLang allows

    state = chat.run()
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user"]
    assert state.messages()[2]["content"] == "Hello" + state["greeting"]


def test_gen_arguments_map_to_sampling_params(mock):
    @sgl.function
    def params(s):
        s += "Go"
        s += sgl.gen("a", 5, 2, stop=["x"], top_k=-1, ignore_eos=True, return_logprob=True)
        s += sgl.gen(
            "b", max_tokens=4, top_logprobs_num=2, return_text_in_logprobs=True, stop_regex="a+"
        )
        s += sgl.gen("c", regex=r"[0-9]+", max_tokens=3)
        s += sgl.gen("d", json_schema=json.dumps({"type": "object"}), max_tokens=3)

    state = params.run(stop_token_ids=[7])
    a, b, c, d = mock.requests
    assert (a.sampling.max_new_tokens, a.sampling.min_new_tokens) == (5, 2)
    assert a.sampling.stop == ["x"] and a.sampling.top_k == 0 and a.sampling.ignore_eos
    assert a.sampling.logprobs and b.sampling.top_logprobs == 2 and b.sampling.stop_regex == ["a+"]
    assert a.sampling.stop_token_ids == [7]  # from the run
    assert c.constraint.regex == "[0-9]+" and d.constraint.json_schema == {"type": "object"}
    assert isinstance(state["d"], str), "SGLang keeps a JSON gen's text"


def test_dtypes_are_sglang_regexes_and_keep_the_text(mock):
    @sgl.function
    def typed(s):
        s += "Hours: " + sgl.gen_int("hours") + "\n"
        s += "Pi: " + sgl.gen("pi", dtype=float) + "\n"
        s += "Name: " + sgl.gen_string("name", max_tokens=8) + "\n"
        s += "Blue? " + sgl.gen("blue", dtype=bool)

    state = typed.run()
    hours, pi, name, blue = mock.requests
    assert hours.constraint.regex == sgl.expr.INT_REGEX and hours.sampling.stop == [" ", "\n"]
    assert pi.constraint.regex == sgl.expr.FLOAT_REGEX and pi.sampling.stop == [" ", "\n"]
    assert name.constraint.regex == sgl.expr.STR_REGEX and name.sampling.stop == []
    assert blue.constraint.regex == sgl.expr.BOOL_REGEX
    assert isinstance(state["hours"], str)
    with pytest.raises(fl.ProgramError, match="dtype must be"):
        sgl.gen("x", dtype=list)


def test_select_with_each_choices_method(mock):
    @sgl.function
    def pick(s, method):
        s += "Answer:" + sgl.select("a", ["True", "False", "Unknown"], choices_method=method)
        s += "\n" + sgl.gen("b", choices=["True", "False"], choices_method=method)

    for method in (
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ):
        mock.score_requests.clear()
        state = pick.run(method=method)
        assert state["a"] == state["b"] == "True"
        unconditional = method.requires_unconditional_logprobs
        assert len(mock.score_requests) == (4 if unconditional else 2)
        meta = state.get_meta_info("a")
        assert len(meta["normalized_prompt_logprobs"]) == 3
        assert len(meta["input_token_logprobs"][0]) == len(mock.tokenize("True"))
        assert ("unconditional_token_logprobs" in meta) == unconditional
    with pytest.raises(NotSupportedError, match="temperature"):
        sgl.select("a", ["x"], temperature=0.5)


def test_greedy_token_selection_is_sglangs_rule():
    # "yes" is a prefix of "yes please": our greedy ends it first, SGLang's compares its mean
    ids, logprobs = [[1], [1, 2]], [[-1.0], [-1.0, -0.5]]
    assert METHODS["greedy"].choose(ids, logprobs).index == 0
    decision = METHODS["greedy_token_selection"].choose(ids, logprobs)
    assert decision.index == 1 and decision.extra["greedy_logprob_matrix"][0] == [-1.0, -1.0]
    tie = METHODS["greedy_token_selection"].choose([[1], [2]], [[-1.0], [-1.0]])
    assert tie.index == 0


def test_fork_group_forms_and_join_modes(mock):
    @sgl.function
    def parallel(s, contexts):
        s += "Tips:\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1}:"
            forks[i] += sgl.gen("tip", 2, stop=["\n\n"])
        forks += "!"
        forks += ["a", "b", "c"]
        forks.join()
        s += "Best: " + s["tip"][0]  # a join's result, read right after the join
        for i in range(3):
            s += f"\nTip {i + 1}:" + forks[i]["tip"]
        memory = s.fork(len(contexts))
        memory += lambda i: f"\nStatement {i}: " + contexts[i]
        memory.join(mode="concate_and_append")
        s += "\nQ:" + sgl.gen("answer", max_tokens=2)

    state = parallel.run(contexts=["x.", "y."])
    assert len(state["tip"]) == 3 and state.text().count("Statement") == 2
    # one pin: the memory fork's branches send nothing before the join
    assert all(p.released for p in mock.pins) and len(mock.pins) == 1
    assert {r.hints.fork_group_size for r in mock.requests[:3]} == {3}
    with pytest.raises(fl.ProgramError, match="join mode"):
        parallel.run(contexts=["x"]).fork(2).join(mode="merge")
    with pytest.raises(fl.ProgramError, match="position_ids_offset"):
        few_shot_qa.run(question="q").fork(2, position_ids_offset=[1])


def test_sglang_lang_paths_names_and_position_offsets(mock):
    """What SGLang's benchmark programs use: `sglang.lang.ir`'s regexes, any string as a
    variable name, and fork(n, position_ids_offset), which (as in SGLang) leaves positions be."""
    from flowlang.sglang.lang.api import gen as api_gen
    from flowlang.sglang.lang.choices import greedy_token_selection
    from flowlang.sglang.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    assert api_gen is sgl.gen and greedy_token_selection is sgl.greedy_token_selection
    for regex, good, bad in [
        (REGEX_INT, "-42 ", "4.2"),
        (REGEX_FLOAT, "3.5", "x"),
        (REGEX_BOOL, "True", "true"),
        (REGEX_STR, '"Paris 2"', '"a,b"'),
    ]:
        assert re.fullmatch(regex, good) and not re.fullmatch(regex, bad)

    @sgl.function
    def named(s, contexts):
        s += "Facts:\n"
        forks = s.fork(len(contexts), [i * 1000 for i in range(len(contexts))])
        forks += lambda i: contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += '"air port code": ' + sgl.gen("air port code", max_tokens=3, stop='"')

    def run(offsets):
        @sgl.function
        def plain(s, contexts):
            s += "Facts:\n"
            forks = s.fork(len(contexts), offsets)
            forks += lambda i: contexts[i] + "\n"
            forks.join(mode="concate_and_append")
            s += '"air port code": ' + sgl.gen("air port code", max_tokens=3, stop='"')

        return plain.run(contexts=["a.", "b."], temperature=0)

    state = named.run(contexts=["a.", "b."], temperature=0)
    assert state.text().startswith("Facts:\na.\nb.\n")
    assert state["air port code"] == run(None)["air port code"], "the offsets change nothing"
    assert "air port code" in state and state.get_meta_info("air port code") is not None
    for bad in ([1], [0, -1], [0, 1.5]):
        with pytest.raises(fl.ProgramError, match="position_ids_offset"):
            run(bad)
    with pytest.raises(fl.ProgramError, match="non-empty string"):
        sgl.gen("", max_tokens=1)


class GatedMock(MockBackend):
    """A MockBackend whose generations wait until `needed` of them have arrived: calls that
    run one after another never get there (the gate times out and says so)."""

    def __init__(self, needed: int) -> None:
        super().__init__()
        self.barrier = threading.Barrier(needed, timeout=5)

    def generate(self, request):
        if "Expand" in self.decode(request.input_ids):
            self.barrier.wait()  # BrokenBarrierError: the nested calls did not overlap
        return super().generate(request)


def test_nested_calls_run_on_the_callers_backend_and_overlap(mock):
    """SGLang's tip_suggestion shape: a program calls another twice, then reads both. The
    nested runs use the caller's backend (not the default one) and run at the same time."""

    @sgl.function
    def expand(s, tip):
        s += "Expand " + tip + ":" + sgl.gen("detail", max_tokens=3)

    @sgl.function
    def tips(s, topic):
        s += "Tips on " + topic + ": 1." + sgl.gen("t1", max_tokens=2, stop="\n")
        s += " 2." + sgl.gen("t2", max_tokens=2, stop="\n")
        first, second = expand(tip=s["t1"]), expand(tip=s["t2"])
        s += "\nA:" + first["detail"] + "\nB:" + second["detail"]

    gated = GatedMock(needed=2)
    states = tips.run_batch([{"topic": "sleep"}], backend=gated, temperature=0)
    assert states[0].error() is None, states[0].error()
    assert sum("Expand" in gated.decode(r.input_ids) for r in gated.requests) == 2
    assert not mock.requests, "the default backend stayed idle"
    assert states[0].text().count("\nA:") == 1


def test_a_concat_join_is_in_the_traced_prompt(mock):
    """The request graph (and so run_batch's shared-prefix pin) sees the text a concat join
    appends, as the run does: the traced prompt is the prompt sent."""

    @sgl.function
    def concat(s, bodies, question):
        s += "Read these lines.\n"
        forks = s.fork(len(bodies))
        forks += lambda i: bodies[i] + "\n"
        forks.join("concate_and_append")
        s += question + sgl.gen("answer", max_tokens=2)

    args = {"bodies": ["Line one is red.", "Line two is blue."], "question": "Which is red?"}
    traced = concat.compile(**args).first_prompt()
    expected = "Read these lines.\nLine one is red.\nLine two is blue.\nWhich is red?"
    assert mock.decode(list(traced)) == expected
    concat.run(**args)
    assert tuple(mock.requests[-1].input_ids) == traced


def test_state_methods(mock):
    @sgl.function
    def tool_use(s, lhs, rhs):
        s += "What is " + str(lhs) + " * " + str(rhs) + "?\n"
        s += "calculate(" + sgl.gen("expression", stop=")") + ") = "
        with s.var_scope("answer"):
            s += str(lhs * rhs)
        with s.copy() as branch:
            branch += sgl.gen("aside", max_tokens=1)
        s.set_var("checked", "yes")
        return s.get_var("answer")

    state = tool_use(lhs=257, rhs=983)
    assert state["answer"] == "252631" and state.ret_value == "252631"
    assert len(state["aside"]) == 1 and state.get_meta_info("aside")[0]["completion_tokens"] == 1
    assert "checked" in state and "missing" not in state and state.error() is None
    state["answer"] = int(state["answer"])  # SGLang programs convert after the run
    assert state["answer"] == 252631


def test_streaming(mock):
    state = answer_mt_bench.run(question_1="Hi", question_2="Again", stream=True)
    text = "".join(state.text_iter())
    assert text == state.text() and state["answer_2"] in text
    state = answer_mt_bench.run(question_1="Hi", question_2="Again", stream=True)
    assert "".join(state.text_iter("answer_1")) == state["answer_1"]

    async def collect():
        streamed = answer_mt_bench.run(question_1="Hi", question_2="Again", stream=True)
        return [piece async for piece in streamed.text_async_iter("answer_2")]

    assert "".join(asyncio.run(collect())) == state["answer_2"]

    async def with_meta():
        streamed = answer_mt_bench.run(question_1="Hi", question_2="Again", stream=True)
        return [pair async for pair in streamed.text_async_iter("answer_1", True)]

    ((text, meta),) = asyncio.run(with_meta())
    assert text == state["answer_1"] and meta["completion_tokens"] == 4


def test_run_batch_and_bind(mock):
    mock.fail_on = "boom"
    states = few_shot_qa.run_batch(
        [{"question": "Japan?"}, ("boom",), ["UK?"]], num_threads=2, progress_bar=False
    )
    assert states[0]["answer"] and states[2]["answer"]
    assert isinstance(states[1], sgl.FailedState) and "boom" in str(states[1].error())
    with pytest.raises(RuntimeError, match="boom"):
        states[1]["answer"]
    bound = few_shot_qa.bind(question="Spain?")
    assert list(bound.run_batch([{}, {}], generator_style=True))[0]["answer"]
    with pytest.raises(fl.ProgramError, match="no arguments"):
        few_shot_qa.bind(topic="x")
    assert "gen answer" in few_shot_qa.trace(question="q").dump()


def test_an_sglang_batch_gets_batch_pins_and_the_prefix_report(mock):
    @sgl.function
    def shots(s, question):
        s += "".join(f"Q: question {i}?\nA: answer {i}.\n" for i in range(12))
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=2)

    questions = [{"question": f"new {i}?"} for i in range(4)]
    shots.run_batch(questions, temperature=0)
    shared = mock.tokenize("".join(f"Q: question {i}?\nA: answer {i}.\n" for i in range(12)))
    (pin,) = mock.pins  # the shared few-shot block, prefilled once for the whole batch
    assert pin.prefix_ids[: len(shared)] == shared and pin.released
    graphs = [shots.compile(**q) for q in questions]
    llama = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    report = graphs[0].prefix_report({**llama, "head_dim": 8}, graphs[1:])
    assert report.num_requests == 4 and report.unique_tokens < report.total_tokens


def test_flowlang_sglang_imports_without_torch():
    blocker = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import flowlang.sglang\n"
        "assert 'torch' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_what_flowlang_cannot_honour_is_a_named_error(mock):
    cases = [
        (lambda: sgl.gen("x", n=2), "n=2"),
        (lambda: sgl.image("cat.png"), "sgl.image"),
        (lambda: sgl.video("cat.mp4", 4), "sgl.video"),
        (lambda: sgl.Runtime(model_path="x"), "flowlang serve"),
        (lambda: few_shot_qa.run(question="q", n=3), "n=3"),
    ]
    for call, message in cases:
        with pytest.raises(NotSupportedError, match=message):
            call()


# ---------------------------------------------------------------- the tiny model, local vs HTTP
def comparable(value):
    """A report without what differs between two runs of the same greedy program: request
    ids and cache hits, and float noise below 1e-3."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in ("id", "cached_tokens")}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return round(value, 3) if isinstance(value, float) else value


# shared programs flowlang.sglang refuses by design (SGLang's frontend runs them on our server)
MISSING: dict[str, str] = {}


def run_all(backend) -> dict:
    """Every program of tests/sglang_programs.py, built with flowlang.sglang, on `backend`;
    those in MISSING must fail with NotSupportedError naming why."""
    sgl.set_default_backend(backend)
    try:
        report = {}
        for name, program in build(sgl).items():
            if name in MISSING:
                with pytest.raises(NotSupportedError, match=MISSING[name]):
                    run(program)
                continue
            report[name] = run(program)
        return report
    finally:
        sgl.set_default_backend(None)


def test_shared_programs_give_the_same_greedy_outputs_locally_and_through_the_server(served):
    from flowlang.backends.local import LocalBackend
    from flowlang.backends.remote import RemoteBackend
    from flowlang.sglang.endpoint import SGLangAPIBackend

    local = run_all(LocalBackend(served.engine))
    remote = sgl.RuntimeEndpoint(served.url)
    plain = sgl.RuntimeEndpoint(served.url, api="sglang")  # SGLang's native API only
    assert isinstance(remote, RemoteBackend) and isinstance(plain, SGLangAPIBackend)
    try:
        over_http, over_sglang_api = run_all(remote), run_all(plain)
    finally:
        remote.close()
        plain.close()
    assert comparable(local) == comparable(over_http)
    assert comparable(local) == comparable(over_sglang_api)
    assert served.engine.stats()["num_pins"] == 0
    check_outputs(local)


def check_outputs(report: dict) -> None:
    """What each program asks for is what it got (the model is random: the form, not sense)."""
    variables = {name: r.get("variables", {}) for name, r in report.items()}
    assert report["multi_turn"]["text"].count("<|im_start|>assistant\n") == 2
    assert len(report["run_batch"]["states"]) == 3
    assert re.fullmatch(r"((\d{1,3})\.){3}\d{1,3}", variables["regex"]["ip"])
    assert set(json.loads(variables["json_schema"]["ticket"])) == {"urgent", "team", "priority"}
    dtypes = variables["dtypes"]
    assert [type(int(dtypes["hours"])), type(float(dtypes["pi"]))] == [int, float]
    assert dtypes["blue"] in ("True", "False") and dtypes["city"].startswith('"')
    for name in ("select_token_length", "select_greedy", "select_unconditional"):
        assert variables[name]["team"] in (" billing", " shipping", " hardware")
    assert variables["gen_choices"]["urgent"] in ("yes", "no")
    assert len(variables["fork_gather"]["tip"]) == 3
    assert "Statement 1: Noah is the father of Julian." in report["fork_concatenate"]["text"]
    assert report["stream_text"]["streamed"] == report["stream_text"]["text"]
    assert not re.search(r"\d|[A-Z]", variables["stop_rules"]["regex_stop"])
    meta = report["logprobs"]["meta"]["answer"]
    assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) <= 6
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_token_logprobs"][0][0] is None
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert len(report["select_token_length"]["meta"]["team"]["normalized_prompt_logprobs"]) == 3
    (chunk,) = report["stream_logprobs"]["chunks"]
    assert len(chunk["meta"]["output_token_logprobs"]) == chunk["meta"]["completion_tokens"]
