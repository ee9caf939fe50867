"""SGLang frontend programs, one per frontend feature, written against SGLang's public API only.

`build(sgl)` takes the module to build with (`sglang`, or `flowlang.sglang`, the drop-in) and
returns the programs by name; `run(program)` runs one and returns what it produced as plain
JSON-able data, so the same programs can run through any backend and their outputs be
compared. Every generation is greedy (temperature 0), so outputs are deterministic.

Importing this file needs neither sglang nor flowlang: the module comes in as a parameter.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "urgent": {"type": "boolean"},
        "team": {"type": "string", "enum": ["billing", "shipping"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["urgent", "team", "priority"],
}
QUESTIONS = ["Where is my parcel?", "The lamp flickers.", "Please cancel my order."]
GREEDY = {"temperature": 0, "max_new_tokens": 16}


@dataclass
class Program:
    """A frontend program and how to run it: "run", "batch" (run_batch over `batch`),
    "stream" (text_iter) or "stream_meta" (text_async_iter with meta data)."""

    function: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    mode: str = "run"
    batch: list[dict[str, Any]] = field(default_factory=list)
    variables: tuple[str, ...] = ()  # what to report besides the text
    meta: tuple[str, ...] = ()  # variables whose meta info to report


def build(sgl: Any) -> dict[str, Program]:
    """Every frontend feature as a program of `sgl` (the sglang module or a drop-in)."""
    programs = {**_chat(sgl), **_control(sgl), **_forks(sgl)}
    return {**programs, **_selects(sgl), **_structured(sgl)}


def _chat(sgl: Any) -> dict[str, Program]:
    @sgl.function
    def multi_turn(s, question_1, question_2):
        s += sgl.system("You are a support agent.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1", max_tokens=12))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2", max_tokens=12)

    @sgl.function
    def few_shot(s, question):
        s += "Q: What is the capital of France?\nA: Paris\n"
        s += "Q: What is the capital of Italy?\nA: Rome\n"
        s += "Q: " + question + "\nA:" + sgl.gen("answer", stop="\n", max_tokens=12)

    @sgl.function
    def chat_stream(s, question):
        s += sgl.system("You are a support agent.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, return_logprob=True))

    @sgl.function
    def role_blocks(s, question):
        s += sgl.user_begin() + question + sgl.user_end()
        s += sgl.assistant_begin() + sgl.gen("answer", max_tokens=8) + sgl.assistant_end()

    question = {"question": QUESTIONS[0]}
    return {
        "multi_turn": Program(
            multi_turn,
            {"question_1": QUESTIONS[0], "question_2": "And when?", **GREEDY},
            variables=("answer_1", "answer_2"),
        ),
        "few_shot": Program(few_shot, {**question, **GREEDY}, variables=("answer",)),
        "run_batch": Program(
            few_shot, GREEDY, "batch", [{"question": q} for q in QUESTIONS], ("answer",)
        ),
        "role_blocks": Program(role_blocks, {**question, **GREEDY}, variables=("answer",)),
        "stream_text": Program(
            chat_stream, {**question, **GREEDY}, "stream", variables=("answer",)
        ),
        "stream_logprobs": Program(
            chat_stream, {**question, **GREEDY}, "stream_meta", (), ("answer",), ("answer",)
        ),
    }


def _control(sgl: Any) -> dict[str, Program]:
    @sgl.function
    def control_flow(s, question):
        # reading a value mid-program, then branching on it in Python
        s += "Question: " + question + "\n"
        s += "Expert:" + sgl.gen("expert", stop=[".", "\n"], max_tokens=8) + ".\n"
        s += "Action: " + sgl.select("action", ["Search", "Finish"]) + "\n"
        if s["action"] == "Search":
            s += "Query: [" + sgl.gen("query", stop="]", max_tokens=8) + "]\n"
        s += "In short," + s["expert"] + sgl.gen("summary", max_tokens=8)

    @sgl.function
    def stops(s):
        s += "Count: one, two, three, four, five, six, seven" + sgl.gen(
            "regex_stop", stop_regex=[r"\d", r"[A-Z]"], max_tokens=24
        )
        s += "\nMore:" + sgl.gen("string_stop", stop=["e", "a"], max_tokens=24)
        s += "\nLonger:" + sgl.gen("min_tokens", min_tokens=6, max_tokens=8, stop="\n")

    @sgl.function
    def logprobs(s, question):
        s += sgl.user(question)
        s += sgl.assistant(
            sgl.gen(
                "answer",
                max_tokens=6,
                return_logprob=True,
                top_logprobs_num=2,
                logprob_start_len=0,
                return_text_in_logprobs=True,
            )
        )

    @sgl.function
    def reasoning(s, question):
        s += sgl.user(question)
        answer = sgl.gen("answer", max_tokens=8)
        s += sgl.assistant(sgl.separate_reasoning(answer, model_type="deepseek-r1"))

    question = {"question": QUESTIONS[0]}
    return {
        "control_flow": Program(control_flow, {**question, **GREEDY}, variables=("action",)),
        "separate_reasoning": Program(
            reasoning, {**question, **GREEDY}, variables=("answer", "answer_reasoning_content")
        ),
        "stop_rules": Program(stops, GREEDY, variables=("regex_stop", "string_stop", "min_tokens")),
        "logprobs": Program(
            logprobs, {**question, **GREEDY}, variables=("answer",), meta=("answer",)
        ),
    }


def _forks(sgl: Any) -> dict[str, Program]:
    @sgl.function
    def fork_gather(s, topic):
        s += "Three short tips about " + topic + ":\n"
        forks = s.fork(3)
        for i in range(3):
            forks[i] += f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=8, stop="\n")
        forks.join()  # gather_variable: s["tip"] is the list of the branches' tips
        for i in range(3):
            s += f"Tip {i + 1}:" + forks[i]["tip"] + "\n"
        s += "Summary:" + sgl.gen("summary", max_tokens=8)

    @sgl.function
    def parallel_encoding(s, question):
        s += "Remember these statements.\n"
        contexts = ["Ethan is the father of Liam.", "Noah is the father of Julian."]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: {contexts[i]}\n"
        forks.join(mode="concate_and_append")
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=8)

    @sgl.function
    def fork_copy(s):
        s += "A story begins."
        with s.copy() as branch:
            branch += sgl.gen("aside", max_tokens=6)
        s += " Then" + sgl.gen("main", max_tokens=6)

    return {
        "fork_gather": Program(fork_gather, {"topic": "packing", **GREEDY}, variables=("tip",)),
        "fork_concatenate": Program(
            parallel_encoding,
            {"question": "Who is Julian's father?", **GREEDY},
            variables=("answer",),
        ),
        "fork_copy": Program(fork_copy, GREEDY, variables=("main",)),
    }


def _selects(sgl: Any) -> dict[str, Program]:
    def make(method: Any) -> Any:
        @sgl.function
        def classify(s, message):
            s += "Message: " + message + "\nThe team for this message is"
            s += sgl.select("team", [" billing", " shipping", " hardware"], choices_method=method)

        return classify

    @sgl.function
    def gen_choices(s, message):
        s += sgl.user("Is this urgent? " + message)
        s += sgl.assistant(sgl.gen("urgent", choices=["yes", "no"]))

    message = {"message": QUESTIONS[0]}
    return {
        "select_token_length": Program(
            make(sgl.token_length_normalized), message, variables=("team",), meta=("team",)
        ),
        "select_greedy": Program(make(sgl.greedy_token_selection), message, variables=("team",)),
        "select_unconditional": Program(
            make(sgl.unconditional_likelihood_normalized), message, variables=("team",)
        ),
        "gen_choices": Program(gen_choices, message, variables=("urgent",)),
    }


def _structured(sgl: Any) -> dict[str, Program]:
    @sgl.function
    def regex(s):
        s += "Q: What is the IP address of the Google DNS servers?\nA: "
        s += sgl.gen("ip", regex=IP_REGEX, max_tokens=32)

    @sgl.function
    def json_schema(s, message):
        s += sgl.user("File a ticket as JSON: " + message)
        s += sgl.assistant(sgl.gen("ticket", json_schema=json.dumps(TICKET_SCHEMA), max_tokens=48))

    @sgl.function
    def dtypes(s):
        s += "Hours in a day: " + sgl.gen_int("hours", max_tokens=4) + "\n"
        s += "Days in a year: " + sgl.gen("days", dtype=int, max_tokens=4) + "\n"
        s += "A city: " + sgl.gen_string("city", max_tokens=8) + "\n"
        s += "A river: " + sgl.gen("river", dtype=str, max_tokens=8) + "\n"
        s += "Pi: " + sgl.gen("pi", dtype=float, max_tokens=6) + "\n"
        s += "Is the sky blue? " + sgl.gen("blue", dtype=bool, max_tokens=4) + "\n"

    @sgl.function
    def var_scope(s):
        s += "A JSON object about Paris:\n"
        with s.var_scope("json_output"):
            s += '{"population": ' + sgl.gen("population", dtype=int, max_tokens=6)
            s += ', "capital": ' + sgl.gen("capital", dtype=bool, max_tokens=4) + "}"

    names = ("hours", "days", "city", "river", "pi", "blue")
    return {
        "regex": Program(regex, GREEDY, variables=("ip",)),
        "json_schema": Program(
            json_schema, {"message": QUESTIONS[2], **GREEDY}, variables=("ticket",)
        ),
        "dtypes": Program(dtypes, GREEDY, variables=names),
        "var_scope": Program(var_scope, GREEDY, variables=("json_output",)),
    }


def run(program: Program) -> dict[str, Any]:
    """Run `program`; its text, variables and reported meta info, as JSON-able data."""
    if program.mode == "batch":
        states = program.function.run_batch(program.batch, **program.kwargs)
        return {"states": [_report(state, program) for state in states]}
    if program.mode == "stream_meta":
        return asyncio.run(_stream_meta(program))
    state = program.function.run(**program.kwargs, stream=program.mode == "stream")
    report: dict[str, Any] = {}
    if program.mode == "stream":
        report["streamed"] = "".join(state.text_iter())
    return {**report, **_report(state, program)}


def _report(state: Any, program: Program) -> dict[str, Any]:
    out: dict[str, Any] = {"text": state.text()}
    out["variables"] = {name: state[name] for name in program.variables}
    out["meta"] = {name: state.get_meta_info(name) for name in program.meta}
    return out


async def _stream_meta(program: Program) -> dict[str, Any]:
    state = program.function.run(**program.kwargs, stream=True)
    chunks = []
    async for text, meta in state.text_async_iter("answer", return_meta_data=True):
        chunks.append({"text": text, "meta": meta})
    return {"chunks": chunks, **_report(state, program)}
