"""The language on MockBackend: every primitive, the graph dump, reports and error cases."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import flowlang as fl
from flowlang import (
    MockBackend,
    ProgramError,
    UnknownVariableError,
    assistant,
    fewshot,
    gen,
    program,
    select,
    system,
    user,
)
from flowlang.backends.mock import MockHandle
from flowlang.errors import ExecutionError, InstanceError


@pytest.fixture
def mock():
    backend = MockBackend(choice_logprobs={" yes": -0.2, " no": -3.0})
    fl.set_default_backend(backend)
    yield backend
    fl.set_default_backend(None)


@program
def qa(s, question):
    s += system("Be brief.")
    s += user(question)
    s += assistant(gen("answer", max_new_tokens=3))
    s += "Correct?"
    s += select("verdict", choices=[" yes", " no"])


def test_text_gen_select_roles_messages_meta(mock):
    state = qa.run("What is 2+2?")
    answer = state["answer"]
    assert answer.startswith(" w") and len(answer.split()) == 3
    assert state["verdict"] == " yes"
    assert state.text() == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        f"What is 2+2?<|im_end|>\n<|im_start|>assistant\n{answer}"
        f"<|im_end|>\nCorrect? yes"
    )
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": answer},
    ]
    assert state.meta("answer")["completion_tokens"] == 3
    assert state.meta("verdict")["scores"][0] > state.meta("verdict")["scores"][1]
    # token stability: the select's prompt extends the gen's prompt and output exactly
    (gen_request,) = mock.requests
    (score_request,) = mock.score_requests
    expected = gen_request.input_ids + mock.tokenize(answer)
    assert score_request.prefix[: len(expected)] == expected


def test_with_role_blocks_and_fewshot(mock):
    @program
    def shots(s, examples):
        with s.user():
            s += fewshot("{% for e in examples %}{{ e.q }}={{ e.a }};{% endfor %}", examples)
            s += " and 3+3?"
        with s.assistant():
            s += gen("a", max_new_tokens=1)

    state = shots.run([{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}])
    assert state.messages()[0] == {"role": "user", "content": "1+1=2;2+2=4; and 3+3?"}
    assert state.messages()[1]["role"] == "assistant"


def test_gen_does_not_block_and_reading_waits(mock):
    release = threading.Event()
    original = mock.generate

    def slow(request):
        release.wait(5)
        return original(request)

    mock.generate = slow
    body_done = threading.Event()
    seen = {}

    @program
    def ahead(s):
        s += "Hello"
        s += gen("x", max_new_tokens=2)
        s += " then"
        s += gen("y", max_new_tokens=2)
        body_done.set()  # both gens appended while the first is still running
        release.set()
        seen["x"] = s["x"]

    state = ahead.run()
    assert body_done.is_set() and seen["x"] == state["x"]
    assert len(mock.requests) == 2


def test_fork_join_gather_and_concat(mock):
    @program
    def branches(s):
        s += "Base."
        forks = s.fork(3)
        for i, b in enumerate(forks):
            b += f" Idea {i}:"
            b += gen("idea", max_new_tokens=2)
        s.join(forks)
        more = s.fork(2)
        for i, b in enumerate(more):
            b += f" Part {i}."
        s.join(more, mode="concat")

    state = branches.run()
    ideas = state["idea"]
    assert isinstance(ideas, list) and len(ideas) == 3 and len(set(ideas)) == 3
    assert state.text() == "Base. Part 0. Part 1."
    # one pin: the second fork's branches send no request, so nothing reads its prefix early
    assert [p.prefix_ids for p in mock.pins] == [mock.tokenize("Base.")]
    assert all(p.released for p in mock.pins), "fork pins are released at join"
    prompts = [r.input_ids for r in mock.requests]
    base = mock.tokenize("Base.")
    assert all(p[: len(base)] == base for p in prompts)
    assert {r.hints.fork_group_size for r in mock.requests} == {3}
    assert len({r.hints.branch_id for r in mock.requests}) == 3


def test_a_join_result_is_readable_in_the_body_right_after_the_join(mock):
    # regression (issue 14): s["x"] right after s.join(forks) raised UnknownVariableError
    seen = {}

    @program
    def gathered(s):
        s += "Base."
        forks = s.fork(2)
        for i, branch in enumerate(forks):
            branch += f" Idea {i}:"
            branch += gen("idea", max_new_tokens=2)
            inner = branch.fork(2)  # nested: the branch's own join declares its names too
            for sub in inner:
                sub += select("pick", choices=[" yes", " no"])
            branch.join(inner)
        s.join(forks)
        seen["idea"], seen["pick"] = s["idea"], s["pick"]
        s += " Best: " + seen["idea"][0]

    state = gathered.run()
    assert seen["idea"] == state["idea"] and len(seen["idea"]) == 2
    assert seen["pick"] == [[" yes", " yes"], [" yes", " yes"]]
    assert state.text().endswith(" Best: " + seen["idea"][0])


def test_sglang_forms_of_the_native_api(mock):
    @program
    def forms(s):
        s += "Q:"
        s += gen(max_new_tokens=1)  # anonymous: appended, kept in no variable
        s += gen("a", max_new_tokens=2)  # the run's sampling fills what a gen leaves unset
        s += select(choices=[" yes", " no"], method=fl.selection.METHODS["greedy"])
        s["note"] = "set by the program"

        s += "Then:" + gen("b", max_new_tokens=1) + "."  # `+` joins text and nodes

    state = forms.run(sampling={"temperature": 0, "max_new_tokens": 3})
    first, second, _ = mock.requests
    assert first.sampling.max_new_tokens == 1 and second.sampling.max_new_tokens == 2
    assert first.sampling.temperature == second.sampling.temperature == 0
    assert set(state.variables()) == {"a", "b", "note"}
    assert state.text().endswith(" yesThen:" + state["b"] + ".")
    assert state["note"] == "set by the program"
    with pytest.raises(ProgramError, match="sampling"):
        forms.run(sampling={"temperature": -1})


def test_run_stream_returns_at_once_and_text_iter_streams_everything(mock):
    release = threading.Event()
    original = mock.generate

    def slow(request):
        release.wait(5)
        return original(request)

    mock.generate = slow

    @program
    def story(s):
        s += "Once"
        s += gen("rest", max_new_tokens=2)

    state = story.run(stream=True)
    pieces = state.text_iter()
    assert next(pieces) == "Once"  # before the gen has finished
    release.set()
    assert "Once" + "".join(pieces) == state.text() == "Once" + state["rest"]
    assert "".join(story.run(stream=True).text_iter("rest"))

    @program
    def broken(s):
        s += "x"
        raise RuntimeError("user bug")

    with pytest.raises(ExecutionError, match="user bug"):
        broken.run(stream=True).text()


def test_text_iter_streams_a_gen(mock):
    @program
    def streamed(s):
        s += "Go"
        s += gen("out", max_new_tokens=3)

    state = streamed.run()
    assert "".join(state.text_iter("out")) == state["out"]


def test_compile_dump_and_prefix_report():
    mock = MockBackend()
    words = lambda n, tag: " ".join(f"{tag}{i}" for i in range(n))  # noqa: E731 - one token a word

    @program
    def chapter(s, system_prompt, examples, q1, q2, rag):
        s += system_prompt
        with_fewshot, with_rag = s.fork(2)
        with_fewshot += " " + examples
        r1, r2 = with_fewshot.fork(2)
        r1 += " " + q1
        r1 += gen("a1", max_new_tokens=8)
        r2 += " " + q2
        r2 += gen("a2", max_new_tokens=8)
        with_rag += " " + rag
        with_rag += gen("a3", max_new_tokens=8)

    graph = chapter.compile(
        words(512, "s"),
        words(1543, "f"),
        words(96, "q"),
        words(80, "p"),
        words(2112, "r"),
        backend=mock,
    )
    llama3_8b = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
    }
    report = graph.prefix_report(llama3_8b)
    assert (report.total_tokens, report.unique_tokens) == (6910, 4343)
    assert report.kv_bytes_per_token == 131072
    assert round(report.bytes_saved / 2**20) == 321
    assert "4,343 unique" in str(report) and "321 MiB" in str(report)
    assert graph.dump().splitlines()[:6] == [
        "program chapter",
        "  text 's0 s1 s2 s3 s4 s5 s6 s7 s8 s9 s10 s11 s12 s13...' (2449 chars)",
        "  fork f1 x2",
        "    branch 0:",
        "      text ' f0 f1 f2 f3 f4 f5 f6 f7 f8 f9 f10 f11 f12 f1...' (8148 chars)",
        "      fork f2 x2",
    ]
    assert "gen a1 (max_new_tokens=8, temperature=1.0)" in graph.dump()
    assert not mock.requests, "compiling runs nothing"


def test_compile_stops_at_a_read_and_says_so():
    @program
    def dependent(s):
        s += "Q"
        s += gen("x", max_new_tokens=2)
        if s["x"]:
            s += gen("y")

    graph = dependent.compile(backend=MockBackend())
    assert graph.partial_reason == "the program reads 'x', a generated value"
    assert [r.name for r in graph.requests] == ["x"]


@program
def bad_join(s, mode):
    s += "x"
    branches = s.fork(2)
    s.join(branches, mode=mode)


def test_a_fork_pins_its_prefix_at_its_branches_first_request(mock):
    """Nested forks pin outer first, each prefix once; a fork whose branches only append text
    before the join pins nothing (the join's prompt is the first to read that prefix)."""

    @program
    def nested(s):
        s += "Base."
        outer = s.fork(2)
        for i, b in enumerate(outer):
            b += f" Outer {i}."
            inner = b.fork(2)
            for j, c in enumerate(inner):
                c += f" Inner {j}:"
                c += gen("x", max_new_tokens=2)
            b.join(inner)
        s.join(outer)
        documents = s.fork(3)
        for i, b in enumerate(documents):
            b += f" Document {i}."
        s.join(documents, mode="concat")
        s += gen("answer", max_new_tokens=2)

    state = nested.run()
    assert "Document 2." in state.text()
    base = mock.tokenize("Base.")
    first, *inner = [p.prefix_ids for p in mock.pins]
    assert first == base  # the outer fork's, before either branch's own
    assert len(inner) == 2 and all(p[: len(base)] == base and len(p) > len(base) for p in inner)
    assert len({tuple(p) for p in inner}) == 2  # each branch's prefix once
    assert all(p.released for p in mock.pins)
    assert len(mock.requests) == 5  # 4 inner gens and the answer


def test_join_mode_is_checked_at_the_call_when_tracing_and_running(mock):
    expected = "join mode must be 'gather' or 'concat', got 'merge'"
    with pytest.raises(ProgramError, match=expected):
        bad_join.compile("merge")
    with pytest.raises(ProgramError, match=expected):
        bad_join.run("merge")
    assert not mock.requests and not mock.pins
    assert bad_join.compile("concat").dump().splitlines()[-1] == "  join f1 (concat)"


def test_tracing_and_running_check_the_same_state_api(mock):
    @program
    def misuse(s, error):
        s += "x"
        first, second = s.fork(2), s.fork(2)
        if error == "fork":
            s.fork(0)
        elif error == "twice":
            s.join(first)
            s.join(first)
        elif error == "mixed":
            s.join([first[0], second[1]])
        elif error == "order":
            s.join(first[::-1])

    cases = {
        "fork": "positive number of branches",
        "twice": "already joined",
        "mixed": "branches of one fork",
        "order": "all branches of the fork, in order",
    }
    for error, message in cases.items():
        with pytest.raises(ProgramError, match=message):
            misuse.compile(error)
        with pytest.raises(ProgramError, match=message):
            misuse.run(error)


@program
def reader(s, read):
    with s.user():
        s += "Q"
    s += gen("x", max_new_tokens=2)
    s.sync()  # nothing to wait for while tracing
    read(s)
    s += gen("never_traced")


def test_tracing_stops_at_any_read_of_run_output():
    reads = [
        (lambda s: s.text(), "the program reads its text"),
        (lambda s: s.token_ids(), "the program reads its token ids"),
        (lambda s: s.messages(), "the program reads its messages"),
        (lambda s: s.variables(), "the program reads its variables"),
        (lambda s: s.meta("x"), "the program reads meta of 'x'"),
        (lambda s: s.get("x"), "the program reads 'x', a generated value"),
        (lambda s: list(s.text_iter("x")), "the program streams 'x', a generated value"),
    ]
    for read, reason in reads:
        graph = reader.compile(read, backend=MockBackend())
        assert graph.partial_reason == reason
        assert [r.name for r in graph.requests] == ["x"]


def test_run_batch_reports_a_failing_instance_and_finishes_the_rest(mock):
    mock.fail_on = "boom"

    @program
    def one(s, topic):
        s += "A shared preamble of some length " * 10 + topic
        s += gen("x", max_new_tokens=2)

    results = one.run_batch([{"topic": t} for t in ("a", "boom", "c")], progress=False)
    assert isinstance(results[1], InstanceError) and "boom" in str(results[1].error)
    assert "Traceback" in results[1].traceback_text
    assert results[0]["x"] and results[2]["x"]
    assert mock.pins and all(p.released for p in mock.pins)
    shared = mock.tokenize(("A shared preamble of some length " * 10).rstrip())
    assert mock.pins[0].prefix_ids[: len(shared)] == shared


def test_arun_and_async_programs(mock):
    @program
    async def native(s):
        s += "Hi"
        s += gen("x", max_new_tokens=1)
        first = await s.aget("x")
        s += first
        s += gen("y", max_new_tokens=1)

    state = asyncio.run(native.arun())
    assert state["y"] and state.text().startswith("Hi" + state["x"] * 2)
    assert qa.run("sync works too")["verdict"] == " yes"
    assert asyncio.run(qa.arun("and async"))["verdict"] == " yes"


def test_error_cases_have_clear_messages(mock):
    @program
    def unknown(s):
        s += "x"
        return s["nope"]

    with pytest.raises(UnknownVariableError, match="no gen/select defines 'nope'"):
        unknown.run()

    @program
    def fork_zero(s):
        s += "x"
        s.fork(0)

    with pytest.raises(ProgramError, match="positive number of branches"):
        fork_zero.run()

    @program
    def join_twice(s):
        s += "x"
        forks = s.fork(2)
        s.join(forks)
        s.join(forks)

    with pytest.raises(ProgramError, match="already joined"):
        join_twice.run()

    @program
    def raises(s):
        s += "x"
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        raises.run()

    with pytest.raises(ProgramError, match="max_new_tokens"):
        gen("x", max_new_tokens=-3)
    with pytest.raises(ProgramError, match="unknown method"):
        select("x", choices=["a"], method="vote")
    with pytest.raises(ProgramError, match="cannot add a int"):
        fl.primitives.to_nodes(3)

    mock.fail_on = "explode"

    @program
    def failing(s):
        s += "explode"
        s += gen("x", max_new_tokens=1)
        s += gen("y", max_new_tokens=1)

    with pytest.raises(ExecutionError, match="refuses prompts"):
        failing.run()


def test_import_without_torch_is_covered_by_test_layering():
    assert MockHandle is not None and time is not None
