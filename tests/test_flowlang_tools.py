"""Tools and reasoning in programs: schemas from signatures and pydantic models, gens with tools
on the tiny random model (every call parses, names a real tool and validates), the hints a
paused branch sends, tool messages with a template that knows tools and with SmolLM2's
(the fallback), run_tools, and `<think>` reasoning split before a constrained answer."""

from __future__ import annotations

import inspect
import json
import re
import shutil
import threading
import time
from typing import Annotated, Literal

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

import flowlang as fl
import flowlang.sglang as sgl
from flowlang import InvalidOutputError, MockBackend, ProgramError, gen, system, tool, user
from flowlang.tools import Call, as_tool

# ---------------------------------------------------------------------- schemas


def test_schema_from_a_function_signature():
    @tool(latency_s=0.25)
    def search(
        query: Annotated[str, Field(description="what to look for")],
        top_k: int = 2,
        json: bool = False,  # a name a pydantic model could not take as a field
    ) -> list[str]:
        """Search the documents.

        Longer notes that stay out of the description.
        """
        return [query] * top_k

    assert search.name == "search" and search.latency_s == 0.25
    assert search.description == "Search the documents."
    assert search.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "top_k": {"type": "integer", "default": 2},
            "json": {"type": "boolean", "default": False},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert search.spec.name == "search" and search("a", 1) == ["a"]  # still callable
    call = search.call('{"query": "lamp", "json": true}', "call_7")
    assert call.arguments == {"query": "lamp", "json": True}
    assert call.value == {"query": "lamp", "top_k": 2, "json": True}
    assert call.run() == ["lamp", "lamp"]
    assert json.loads(call.tool_call.arguments) == call.arguments
    with pytest.raises(InvalidOutputError, match="invalid arguments"):
        search.call({"top_k": 1})  # query missing
    with pytest.raises(InvalidOutputError, match="invalid arguments"):
        search.call({"query": "x", "other": 1})
    with pytest.raises(InvalidOutputError, match="not JSON"):
        search.call("{query")


def test_a_pydantic_model_is_a_tool_whose_value_is_the_instance():
    class Weather(BaseModel):
        """Report the weather in a city."""

        city: str
        celsius: float = Field(description="the temperature")

    class Titled(BaseModel):
        model_config = ConfigDict(title="set_alarm")
        hour: int

    weather = as_tool(Weather)
    assert weather.name == "Weather" and weather.description == "Report the weather in a city."
    assert weather.parameters["required"] == ["city", "celsius"]
    assert "title" not in weather.parameters and "title" not in weather.parameters["properties"]
    call = weather.call({"city": "Oslo", "celsius": -3})
    assert isinstance(call.value, Weather) and call.value.celsius == -3.0
    assert call.run() is call.value
    assert as_tool(Titled).name == "set_alarm" and as_tool(Titled).description == ""


def test_tool_misuse_is_a_program_error():
    with pytest.raises(ProgramError, match="name"):
        tool(lambda x: x)  # "<lambda>"
    with pytest.raises(ProgramError, match="named arguments"):
        tool(lambda *args: args, name="star")
    with pytest.raises(ProgramError, match="latency_s"):
        tool(lambda x: x, name="f", latency_s=-1)

    def f(x: int) -> int:
        return x

    with pytest.raises(ProgramError, match="two tools"):
        gen("x", tools=[f, f])
    with pytest.raises(ProgramError, match="cannot be combined"):
        gen("x", tools=[f], regex="a+")
    with pytest.raises(ProgramError, match="tool_choice"):
        gen("x", tools=[f], tool_choice="g")
    with pytest.raises(ProgramError, match="needs tools"):
        gen("x", tool_choice="required")
    with pytest.raises(ProgramError, match="unknown reasoning"):
        gen("x", reasoning="nope")
    with pytest.raises(ProgramError, match="needs reasoning"):
        gen("x", max_reasoning_tokens=4)
    assert gen("x", tools=[f], tool_choice=as_tool(f)).tool_choice == "f"


TYPES = {  # key -> (annotation, values, a default)
    "int": (int, st.integers(-1000, 1000), 0),
    "float": (float, st.floats(-1e6, 1e6, allow_nan=False), 0.5),
    "str": (str, st.text(max_size=8), ""),
    "bool": (bool, st.booleans(), False),
    "ints": (list[int], st.lists(st.integers(0, 9), max_size=3), [1]),
    "color": (Literal["red", "green"], st.sampled_from(["red", "green"]), "red"),
    "maybe": (str | None, st.one_of(st.none(), st.text(max_size=4)), None),
}


@st.composite
def signatures(draw):
    """A signature (name -> (type key, has default)) and arguments that fit it."""
    keys = draw(st.lists(st.sampled_from(sorted(TYPES)), min_size=0, max_size=5))
    params, arguments = {}, {}
    for index, key in enumerate(keys):
        has_default = draw(st.booleans())
        params[f"arg_{index}"] = (key, has_default)
        if not has_default or draw(st.booleans()):
            arguments[f"arg_{index}"] = draw(TYPES[key][1])
    return params, arguments


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(signatures())
def test_generated_signatures_give_schemas_that_accept_their_calls(case):
    params, arguments = case
    defaults = {}
    parameters = []
    for name, (key, has_default) in params.items():
        default = inspect.Parameter.empty
        if has_default:
            default = defaults[name] = TYPES[key][2]
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default))

    def echo(**kwargs):
        return kwargs

    echo.__signature__ = inspect.Signature(parameters)
    echo.__annotations__ = {name: TYPES[key][0] for name, (key, _) in params.items()}
    made = tool(echo)
    schema = made.parameters
    assert list(schema["properties"]) == list(params)
    assert schema.get("required", []) == [n for n, (_, d) in params.items() if not d]
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(arguments, schema)
    assert made.call(arguments).run() == {**defaults, **arguments}
    if any(key == "int" for key, _ in params.values()):
        name = next(n for n, (key, _) in params.items() if key == "int")
        with pytest.raises(InvalidOutputError):
            made.call({**arguments, name: "not a number"})


# ---------------------------------------------------------------------- on the tiny model


@tool(latency_s=0.5)
def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
    """Add two numbers."""
    return a + b


@tool(latency_s=2.0)
def weather(city: Literal["Paris", "Rome", "Oslo"], unit: Literal["C", "F"] = "C") -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@tool
def note(text: Annotated[str, Field(max_length=6)]) -> str:
    """Keep a short note."""
    return text


TOOLS = [add, weather, note]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    with Engine(EngineConfig(model=str(tiny_model_dir), max_kv_tokens=30_000)) as engine:
        yield engine


@fl.program
def step(s, choice, seed, parallel=True, max_new_tokens=64):
    s += system("You are a helpful assistant.", tools=TOOLS)
    s += user("What is 2 + 3, and the weather in Rome?")
    with s.assistant():
        s += gen(
            "step",
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_new_tokens=max_new_tokens,
            temperature=1.0,
            seed=seed,
        )


def check_calls(calls, allowed=TOOLS) -> None:
    """Every call names an offered tool and its arguments fit the tool's JSON schema."""
    by_name = {t.name: t for t in allowed}
    assert calls and all(isinstance(c, Call) for c in calls)
    for call in calls:
        assert call.name in by_name
        jsonschema.validate(call.arguments, by_name[call.name].parameters)


def test_required_and_named_tool_calls_always_validate(engine):
    from flowlang.backends.local import LocalBackend

    backend = LocalBackend(engine)
    required = [{"choice": "required", "seed": i, "parallel": i % 2 == 0} for i in range(40)]
    named = [{"choice": "weather", "seed": 100 + i} for i in range(10)]
    states = step.run_batch(required + named, backend=backend, progress=False)
    failed = [s for s in states if isinstance(s, fl.InstanceError)]
    assert not failed, failed[0]
    invalid = 0
    for args, state in zip(required + named, states, strict=True):
        calls = state["step"]
        check_calls(calls, [weather] if args["choice"] == "weather" else TOOLS)
        meta = state.meta("step")
        assert [c.tool_call.arguments for c in calls] == [w.arguments for w in meta["tool_calls"]]
        if not args.get("parallel", True):
            assert len(calls) == 1
        invalid += sum(c.name not in {t.name for t in TOOLS} for c in calls)
        # the calls stay in the text exactly as decoded (the next turn extends that KV)
        assert meta["raw_text"] in state.text()
    assert invalid == 0
    assert len({s["step"][0].name for s in states[:40]}) > 1  # the tools are really sampled


def test_none_gives_text_and_auto_gives_valid_calls_or_text(engine):
    from flowlang.backends.local import LocalBackend

    backend = LocalBackend(engine)
    batch = [{"choice": "none", "seed": i} for i in range(4)]
    batch += [{"choice": "auto", "seed": i} for i in range(8)]
    states = step.run_batch(batch, backend=backend, progress=False)
    for args, state in zip(batch, states, strict=True):
        value = state["step"]
        if args["choice"] == "none":
            assert isinstance(value, str) and "<tool_call>" not in value
            assert state.meta("step")["tool_calls"] == []
        elif isinstance(value, str):
            assert state.meta("step")["content"] == value
        else:
            check_calls(value)


def test_a_gen_with_tools_is_a_paused_branch_in_its_hints(engine):
    from flowlang.backends.local import LocalBackend

    backend = LocalBackend(engine, record=True)
    step.run("required", 0, backend=backend)

    @fl.program
    def declared(s):
        s += user("hi")
        s += gen("a", tools=TOOLS, tool_choice="none", max_new_tokens=2)
        s += gen("b", tools=[note], max_new_tokens=2)  # no tool declares a latency
        s += gen("c", tools=TOOLS, next_turn_after_s=7.0, max_new_tokens=2)

    declared.run(backend=backend)
    hints = [request.hints for request, _ in backend.generations]
    assert hints[0].continuation and hints[0].next_turn_after_s == 2.0  # the slowest tool
    # "none" is no pause for tools (b, queued behind it, makes it a continuation anyway)
    assert hints[1].continuation and hints[1].next_turn_after_s is None
    assert hints[2].continuation and hints[2].next_turn_after_s is None
    assert hints[3].continuation and hints[3].next_turn_after_s == 7.0
    # each gen that may call tools says its next turn waits on them, latency known or not
    assert [h.waits_on_tools for h in hints] == [True, False, True, True]
    assert all(r.constraint.kind == "structural_tag" for r, _ in backend.generations)


def test_smollm2_template_gets_the_fallback_tools_section_and_tool_responses(engine):
    from flowlang.backends.local import LocalBackend
    from runtime.constrain.tool_calls import tool_format

    backend = LocalBackend(engine)
    assert not backend.chat_format.supports_tools and backend.tool_format == "hermes"

    @fl.program
    def one_round(s):
        s += system("Be brief.", tools=[add, weather])
        s += user("2 + 3?")
        with s.assistant():
            s += gen("step", tools=[add, weather], tool_choice="add", max_new_tokens=48)
        s.run_tools(s["step"])
        with s.assistant():
            s += gen("answer", max_new_tokens=4, temperature=0)

    state = one_round.run(backend=backend)
    (call,) = state["step"]
    messages = state.messages()
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(add.spec.parameters) in messages[0]["content"]
    assert (
        tool_format("hermes").call_text("function_name", {"argument": "value"})
        in (messages[0]["content"])
    )
    assert messages[3] == {
        "role": "tool",
        "content": str(call.run()),
        "tool_call_id": "call_0",
        "name": "add",
    }
    tail = f"<|im_start|>user\n<tool_response>\n{call.run()}\n</tool_response><|im_end|>\n"
    assert tail + "<|im_start|>assistant\n" in state.text()


# A small template that knows tools: definitions in the system message, calls as <tool_call>,
# consecutive tool results grouped into one turn (as Qwen2.5's does, written anew here)
TOOLS_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>tool' }}{% endif %}"
    "{{ '\\n<result id=\"' + message.tool_call_id + '\">' + message.content + '</result>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{% if message.role == 'system' and tools %}"
    "{{ '\\n\\nFunctions you may call:' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '\\n<tool_call>' + call.function.name + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def model_with_template(source, folder, template: str):
    """A copy of the tiny model whose chat template is `template`."""
    shutil.copytree(source, folder)
    (folder / "chat_template.jinja").write_text(template)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_template_with_tools_renders_definitions_and_tool_messages(tiny_model_dir, tmp_path):
    from flowlang.backends.local import LocalBackend
    from runtime.config import EngineConfig
    from runtime.engine import Engine

    folder = model_with_template(tiny_model_dir, tmp_path / "tools-model", TOOLS_TEMPLATE)
    with Engine(EngineConfig(model=str(folder), max_kv_tokens=8_000)) as engine:
        backend = LocalBackend(engine)
        assert backend.chat_format.supports_tools

        @fl.program
        def round_trip(s):
            s += system("Be brief.", tools=[add, weather])
            s += user("2 + 3, and Rome?")
            with s.assistant():
                s += gen("step", tools=[add, weather], tool_choice="required", max_new_tokens=48)
            calls = [add.call({"a": 2, "b": 3}, "c1"), weather.call({"city": "Rome"}, "c2")]
            s.run_tools(calls)
            s += fl.tool_result(add.call({"a": 1, "b": 1}, "c3"), {"sum": 2})
            with s.assistant():
                s += gen("answer", max_new_tokens=4, temperature=0)

        state = round_trip.run(backend=backend)
        check_calls(state["step"], [add, weather])
        text = state.text()
        from runtime.constrain.tool_prompt import openai_tools

        system_message = backend.chat_format.render(
            [{"role": "system", "content": "Be brief."}],
            tools=openai_tools([add.spec, weather.spec]),
        )
        assert text.startswith(system_message) and "Functions you may call:" in system_message
        # one round's results are one tool turn, as the template groups them
        assert (
            '<|im_start|>tool\n<result id="c1">5</result>\n<result id="c2">sunny in Rome'
            "</result><|im_end|>\n"
        ) in text
        assert '<|im_start|>tool\n<result id="c3">{"sum": 2}</result><|im_end|>\n' in text
        roles = [m["role"] for m in state.messages()]
        assert roles == ["system", "user", "assistant", "tool", "tool", "tool", "assistant"]


def test_tools_where_the_template_cannot_show_them_are_refused():
    from flowlang.chat import ChatFormat

    start_only = ChatFormat(  # shows tools once, before the whole conversation
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    definitions = [{"type": "function", "function": {"name": "add"}}]
    first = start_only.markup("system", first=True, tools=definitions)
    assert first.prefix.startswith("TOOLS ") and first.suffix == "\n"
    with pytest.raises(ProgramError, match="first message"):
        start_only.markup("system", first=False, tools=definitions)


# ---------------------------------------------------------------------- run_tools


@pytest.fixture
def mock():
    return MockBackend()


def test_run_tools_runs_calls_at_once_in_order_and_errors_become_results(mock):
    started = []
    lock = threading.Lock()

    @tool(latency_s=0.3)
    def slow(label: str) -> str:
        """Take a while."""
        with lock:
            started.append(label)
        time.sleep(0.3)
        return label.upper()

    @tool
    def broken(x: int) -> int:
        """Always fails."""
        raise RuntimeError(f"no {x}")

    calls = [slow.call({"label": f"l{i}"}, f"call_{i}") for i in range(4)]
    calls.insert(2, broken.call({"x": 3}, "call_x"))

    @fl.program
    def round_(s):
        s += user("go")
        with s.assistant():
            s += "calling"
        s.run_tools(calls)
        s += gen("after", max_new_tokens=2)

    began = time.perf_counter()
    state = round_.run(backend=mock)
    assert time.perf_counter() - began < 1.0  # four 0.3 s calls at once, not one by one
    assert sorted(started) == ["l0", "l1", "l2", "l3"]
    values = state["tool_results"]
    assert values[:2] == ["L0", "L1"] and values[3:] == ["L2", "L3"]
    assert isinstance(values[2], RuntimeError)
    meta = state.meta("tool_results")
    assert list(meta["errors"]) == ["call_x"] and meta["calls"] == calls
    assert meta["texts"][2] == '{"error": "RuntimeError: no 3"}'
    tools = [m for m in state.messages() if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tools] == [c.id for c in calls]
    # MockBackend's ChatML knows no tools: one user message of <tool_response> blocks
    blocks = "\n".join(f"<tool_response>\n{t}\n</tool_response>" for t in meta["texts"])
    assert f"<|im_start|>user\n{blocks}<|im_end|>\n" in state.text()
    assert state["after"]  # the program went on


def test_run_tools_inside_the_open_message_and_on_text_are_clear_errors(mock):
    call = add.call({"a": 1, "b": 2})

    @fl.program
    def inside(s):
        s += user("go")
        with s.assistant():
            s += "calling"
            s.run_tools([call])

    with pytest.raises(ProgramError, match="still open"):
        inside.run(backend=mock)

    @fl.program
    def on_text(s):
        s += user("go")
        s.run_tools("a text answer")

    with pytest.raises(ProgramError, match="list of Calls"):
        on_text.run(backend=mock)


def test_a_name_defined_each_round_is_read_after_its_last_definition(mock):
    original = mock.generate

    def slow(request):  # each round's gen still runs when the body reads its name
        time.sleep(0.1)
        return original(request)

    mock.generate = slow
    seen = []

    @fl.program
    def rounds(s):
        s += user("go")
        for i in range(3):
            s += gen("step", max_new_tokens=i + 1)
            seen.append(s["step"])  # this round's, not the previous round's value

    rounds.run(backend=mock)
    assert [len(v.split()) for v in seen] == [1, 2, 3]


def test_tools_and_tool_results_trace_into_the_graph(mock):
    @fl.program
    def traced(s):
        s += system("Be brief.", tools=[add])
        s += user("hi")
        with s.assistant():
            s += "calling"
        s += fl.tool_result(add.call({"a": 1, "b": 2}, "call_0"), 3)
        with s.assistant():
            s += gen("answer", max_new_tokens=2)

    graph = traced.compile(backend=mock)
    state = traced.run(backend=mock)
    (request,) = mock.requests
    assert graph.first_prompt() == tuple(request.input_ids)  # the tool message rendered too
    assert state.meta("answer")["prompt_tokens"] == len(request.input_ids)


# ---------------------------------------------------------------------- reasoning

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


# a JSON answer that leaves no room for whitespace inside it: structural tags' JSON allows any
# whitespace between tokens, which a random model fills until max_new_tokens
VERDICT = {"type": "string", "enum": ["yes", "no", "unsure"]}


def test_reasoning_is_split_and_the_schema_applies_after_it(tiny_model_dir, tmp_path):
    from flowlang.backends.local import LocalBackend
    from runtime.config import EngineConfig
    from runtime.constrain.reasoning import reasoning_format
    from runtime.engine import Engine

    folder = model_with_template(tiny_model_dir, tmp_path / "think-model", THINK_TEMPLATE)
    with Engine(EngineConfig(model=str(folder), max_kv_tokens=8_000)) as engine:
        backend = LocalBackend(engine, record=True)
        assert backend.reasoning_format == "deepseek-r1"

        @fl.program
        def judged(s, seed):
            s += user("Is 2 + 2 = 4? Think, then answer as JSON.")
            with s.assistant():  # the template's generation prompt opens <think>
                s += "<think>\n"
                s += gen(
                    "verdict",
                    reasoning=True,
                    max_reasoning_tokens=12,
                    schema=VERDICT if seed % 2 else None,
                    regex=None if seed % 2 else r"(yes|no), [0-9]",
                    max_new_tokens=48,
                    temperature=1.0,
                    seed=seed,
                )

        states = judged.run_batch([{"seed": i} for i in range(8)], backend=backend, progress=False)
        failed = [s for s in states if isinstance(s, fl.InstanceError)]
        assert not failed, failed[0]
        for seed, state in enumerate(states):
            meta = state.meta("verdict")
            assert meta["reasoning"] is not None and "</think>" in meta["raw_text"]
            answer = meta["raw_text"].split("</think>", 1)[1].lstrip("\n")
            if seed % 2:  # validated: the answer after </think>, parsed as JSON
                jsonschema.validate(state["verdict"], VERDICT)
                assert json.loads(answer) == state["verdict"]
            else:
                assert (
                    re.fullmatch(r"(yes|no), [0-9]", state["verdict"])
                    and answer == state["verdict"]
                )
        (request, _) = backend.generations[0]
        assert request.constraint.kind == "structural_tag"

        @sgl.function
        def separated(s, question):
            s += sgl.user(question)
            s += sgl.assistant_begin() + "<think>\n"
            s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=16), model_type="deepseek-r1")
            s += sgl.assistant_end()

        state = separated.run(question="Why?", temperature=0, backend=backend)
        reasoning, answer = state["answer_reasoning_content"], state["answer"]
        raw = state.meta("answer")["raw_text"]
        fmt_split = reasoning_format("deepseek-r1").split(raw, True)
        assert (reasoning, answer) == fmt_split
        assert raw in state.text()  # the text keeps what was decoded


def test_reasoning_needs_a_format_and_separate_reasoning_takes_sglangs_forms(mock):
    @fl.program
    def thinks(s):
        s += user("hi")
        s += gen("x", reasoning=True, max_new_tokens=2)

    with pytest.raises(ProgramError, match="no reasoning format"):
        thinks.run(backend=mock)

    @fl.program
    def named(s):
        s += user("hi")
        s += gen("x", reasoning="deepseek-r1", max_new_tokens=2)

    state = named.run(backend=mock)  # no </think>: all of it is reasoning, as SGLang's parser
    assert state["x"] == "" and state.meta("x")["reasoning"] == state.meta("x")["raw_text"]

    expr = sgl.separate_reasoning(sgl.gen("answer"), model_type="qwen3")
    assert expr[0].reasoning == "think" and expr[0].reasoning_var == "answer_reasoning_content"
    assert len(sgl.separate_reasoning(None)) == 0
    with pytest.raises(sgl.NotSupportedError, match="select"):
        sgl.separate_reasoning(sgl.select("x", choices=["a", "b"]), model_type="qwen3")
    with pytest.raises(sgl.NotSupportedError, match="unknown reasoning"):
        sgl.separate_reasoning(sgl.gen("answer"), model_type="glm45")


def test_parallel_calls_as_fork_branches(engine):
    """fork_tools: the calls run at once, branch i holds call i's result as its tool message
    and generates from there; the shared prefix is pinned once, the branches join."""
    from flowlang.backends.local import LocalBackend

    calls = [add.call({"a": i, "b": 1}, f"call_{i}") for i in range(3)]

    @fl.program
    def per_call(s):
        s += system("You are a helpful assistant.", tools=[add])
        s += user("Three sums, please.")
        with s.assistant():
            s += "calling"
        branches = s.fork_tools(calls)
        for branch in branches:
            with branch.assistant():
                branch += gen("summary", max_new_tokens=3, temperature=0)
        s.join(branches)

    backend = LocalBackend(engine, record=True)
    pins_before = engine.stats()["num_pins"]
    state = per_call.run(backend=backend)
    assert state["tool_result"] == [1, 2, 3] and len(state["summary"]) == 3
    prompts = [list(r.input_ids) for r, _ in backend.generations]
    assert len(prompts) == 3 and {r.hints.fork_group_size for r, _ in backend.generations} == {3}
    texts = [engine.tokenizer.decode(p) for p in prompts]
    seen = [re.findall(r"<tool_response>\n(\d)\n</tool_response>", t) for t in texts]
    assert sorted(seen) == [["1"], ["2"], ["3"]]  # each branch sees its own call's result only
    head = engine.tokenizer.encode(texts[0][: texts[0].index("<|im_start|>user\n<tool_")])
    assert all(p[: len(head)] == head for p in prompts)  # the pinned prefix, shared
    assert engine.stats()["num_pins"] == pins_before  # the fork's pin is released at the join
    with pytest.raises(ProgramError, match="fork_tools"):
        per_call_empty = fl.program(lambda s: s.fork_tools([]))
        per_call_empty.run(backend=backend)
