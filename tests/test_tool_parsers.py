"""Tool call parsing (runtime/constrain/tool_calls/) on recorded and handwritten outputs of
each family, template detection, and the streaming parser against the whole-text one."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.constrain.tool_calls import (
    FORMAT_NAMES,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolFormat,
    UnknownToolFormat,
    detect_tool_format,
    template_supports_tools,
    tool_format,
)
from runtime.protocol import ToolSpec

WEATHER = ToolSpec(
    name="get_weather",
    description="the weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
CLOCK = ToolSpec(name="clock")
TOOLS = [WEATHER, CLOCK]
HERMES, LLAMA3, MISTRAL = (tool_format(name) for name in FORMAT_NAMES)


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.calls]


def streamed(fmt: ToolFormat, text: str, cuts: list[int], tools=TOOLS):
    """(content, [(name, arguments)]) of `text` fed to a stream in pieces cut at `cuts`."""
    stream, events, start = fmt.stream(tools), [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += stream.feed(text[start:cut])
        start = max(start, cut)
    events += stream.finish()
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            assert event.id.startswith("call_") and len(event.id) == 29
            calls.append([event.name, ""])
        else:
            assert isinstance(event, ArgumentsDelta) and event.index == len(calls) - 1
            calls[-1][1] += event.text
    return content, [tuple(call) for call in calls]


# ---- names and detection ----


def test_names_and_aliases():
    assert [tool_format(n).name for n in ("qwen", "qwen25", "qwen3", "Hermes")] == ["hermes"] * 4
    assert tool_format("llama").name == tool_format("llama3_json").name == "llama3"
    assert tool_format("mistral").trigger == "[TOOL_CALLS]"
    with pytest.raises(UnknownToolFormat, match="unknown tool call parser 'pythonic'.*hermes"):
        tool_format("pythonic")
    assert issubclass(UnknownToolFormat, ValueError)


QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {{- \"\\n\\n# Tools\\n\\nYou "
    "may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    'function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in '
    'tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- '
    '"\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- endif %}{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}"
    "\n{%- endif %}\n{%- if builtin_tools is defined or tools is not none %}\n    {{- "
    '"Environment: ipython\\n" }}\n{%- endif %}\n'
    "{%- for message in messages %}{%- if 'tool_calls' in message %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- else %}'
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    '{{- tool_call.arguments | tojson }}{{- "}" }}{%- endif %}{{- "<|eot_id|>" }}'
    "{%- endif %}{%- endfor %}"
)
LLAMA32_TEMPLATE = (  # Llama-3.2 1B/3B: JSON calls, no <|python_tag|>
    "{%- if tools is not none %}{{- 'Given the following functions, please respond with a JSON "
    "for a function call with its proper arguments that best answers the given prompt.\\n\\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}{%- endif %}{{- '<|eot_id|>' }}"
)
MISTRAL_TEMPLATE = (
    "{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if tools is not none and (message == user_messages[-1]) %}"
    "{{- '[AVAILABLE_TOOLS] [' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}"
    '{{- \'{"name": "\' + tool_call.function.name + \'", "arguments": \' }}'
    "{{- tool_call.function.arguments | tojson }}{{- '}' }}{%- endfor %}{{- ']' + eos_token }}"
    "{%- endif %}{%- endfor %}"
)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, family, knows_tools",
    [
        (QWEN25_TEMPLATE, "hermes", True),
        (LLAMA31_TEMPLATE, "llama3", True),
        (LLAMA32_TEMPLATE, "llama3", True),
        (MISTRAL_TEMPLATE, "mistral", True),
        (SMOLLM2_TEMPLATE, "hermes", False),
        (None, "hermes", False),
        ("", "hermes", False),
        ("{{ 'Use these tools wisely' }}{# tools #} tools", "hermes", False),
    ],
)
def test_detection_from_chat_templates(template, family, knows_tools):
    assert detect_tool_format(template) == family
    assert template_supports_tools(template) is knows_tools


# ---- call text ----


def test_call_text_per_family():
    args = {"city": "Zürich", "days": 2}
    assert HERMES.call_text("get_weather", args) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}'
        "\n</tool_call>"
    )
    assert LLAMA3.call_text("get_weather", args) == (
        '{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}'
    )
    assert MISTRAL.call_text("get_weather", args) == (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}]'
    )
    two = [("clock", {}), ("clock", {})]
    assert HERMES.calls_text(two).count("</tool_call>\n<tool_call>") == 1
    assert LLAMA3.calls_text(two) == '{"name": "clock", "parameters": {}}; ' * 1 + (
        '{"name": "clock", "parameters": {}}'
    )
    assert MISTRAL.calls_text(two).count("[TOOL_CALLS]") == 2


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=FORMAT_NAMES)
def test_own_call_text_parses_back(fmt):
    calls = [("get_weather", {"city": "東京", "days": 3}), ("clock", {})]
    for some in (calls[:1], calls):
        parsed = fmt.parse(fmt.calls_text(some), TOOLS)
        assert parsed.content == ""
        assert calls_of(parsed) == some
        assert parsed.calls[0].arguments == json.dumps(some[0][1], ensure_ascii=False)
    ids = [call.id for call in fmt.parse(fmt.calls_text(calls), TOOLS).calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    int(ids[0][5:], 16)


# ---- hermes (Qwen2.5 / Qwen3 / Hermes) ----

QWEN_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
QWEN_TWO = (
    "I'll look up both cities.\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'
)


def test_hermes_recorded_outputs():
    parsed = HERMES.parse(QWEN_ONE, TOOLS)
    assert parsed.content == "" and calls_of(parsed) == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": 2}'
    parsed = HERMES.parse(QWEN_TWO, TOOLS)
    assert parsed.content == "I'll look up both cities."
    assert calls_of(parsed) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Berlin"}),
    ]
    # text after a call is kept, joined by the whitespace that stood before the call
    parsed = HERMES.parse("Checking.\n" + QWEN_ONE + "\n\nDone, I will wait.", TOOLS)
    assert parsed.content == "Checking.\nDone, I will wait." and len(parsed.calls) == 1
    parsed = HERMES.parse(QWEN_ONE + "\n\nThat was it.\n", TOOLS)
    assert parsed.content == "That was it.\n"
    # compact JSON, and no closing tag at the very end (the model stopped at EOS)
    parsed = HERMES.parse('<tool_call>{"name":"clock","arguments":{}}', TOOLS)
    assert calls_of(parsed) == [("clock", {})] and parsed.content == ""
    parsed = HERMES.parse('<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_', TOOLS)
    assert calls_of(parsed) == [("clock", {})] and parsed.content == ""


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_call> tags to call a function, like this: <tool_call>",
        "<tool_call>\nI would call get_weather here.\n</tool_call>",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # unknown tool
        '<tool_call>\n[{"name": "clock", "arguments": {}}]\n</tool_call>',  # a list
        '<tool_call>\n{"name": "clock", "arguments": "{}"}\n</tool_call>',  # arguments a string
        '<tool_call>\n{"name": "clock", "arguments": []}\n</tool_call>',
        '<tool_call>\n{"name": "clock"}\n</tool_call>',  # no arguments
        '<tool_call>\n{"name": "clock", "arguments": {}, "extra": 1}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"name": "clock", "arguments": {}},\n</tool_call>',  # text before the tag
        '<tool_call>\n{"name": "clock", "arguments": {}}\nand more text',  # never closed
        '<tool_call>\n{"name": "clock", "arguments": {"a": NaN}}\n</tool_call>',
        '<tool_call>\n{"name": "clock", "arguments": {"a": "\\ud800"}}\n</tool_call>',
        "<tool_call>\n" + "[" * 5000 + "]" * 5000,
        "<tool_call>\n{" + '"a":[' * 3000 + "]" * 3000 + "}\n</tool_call>",  # deeper than json
        "<tool_call",
    ],
)
def test_hermes_not_calls_stay_text(text):
    parsed = HERMES.parse(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_bad_call_next_to_good_one():
    bad = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    parsed = HERMES.parse(bad + "\n" + QWEN_ONE, TOOLS)
    assert parsed.content == bad and len(parsed.calls) == 1
    # a trigger inside a broken call's text starts a candidate of its own
    parsed = HERMES.parse("<tool_call> oops " + QWEN_ONE, TOOLS)
    assert parsed.content == "<tool_call> oops" and len(parsed.calls) == 1


def test_hermes_unicode_arguments():
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\u00e3o Paulo 🌧"}}\n'
        "</tool_call>"
    )
    parsed = HERMES.parse("Olá! " + text, TOOLS)
    assert parsed.content == "Olá!"
    assert parsed.calls[0].arguments == '{"city": "São Paulo 🌧"}'


def test_no_tools_means_no_calls():
    assert HERMES.parse(QWEN_ONE, []).content == QWEN_ONE
    assert streamed(HERMES, QWEN_ONE, [3, 20], tools=[]) == (QWEN_ONE, [])


# ---- llama3 ----

LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_llama3_recorded_outputs():
    parsed = LLAMA3.parse(LLAMA_ONE, TOOLS)
    assert parsed.content == "" and calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    parsed = LLAMA3.parse("<|python_tag|>" + LLAMA_ONE, TOOLS)
    assert parsed.content == "" and len(parsed.calls) == 1
    two = LLAMA_ONE + "; " + '{"name": "clock", "arguments": {}}'
    assert calls_of(LLAMA3.parse(two, TOOLS)) == [("get_weather", {"city": "Paris"}), ("clock", {})]
    assert LLAMA3.parse(two, TOOLS).content == ""
    parsed = LLAMA3.parse(LLAMA_ONE + "\n" + LLAMA_ONE, TOOLS)
    assert parsed.content == "" and len(parsed.calls) == 2
    parsed = LLAMA3.parse("Sure, let me check.\n" + LLAMA_ONE + "\nWaiting for it.", TOOLS)
    assert parsed.content == "Sure, let me check.\nWaiting for it." and len(parsed.calls) == 1
    parsed = LLAMA3.parse('{ "name" : "clock" , "parameters" : { } }', TOOLS)
    assert calls_of(parsed) == [("clock", {})]
    listed = '[{"name": "clock", "parameters": {}}, ' + LLAMA_ONE + "]"  # all calls, or text
    assert calls_of(LLAMA3.parse(listed, TOOLS)) == [
        ("clock", {}),
        ("get_weather", {"city": "Paris"}),
    ]
    parsed = LLAMA3.parse(LLAMA_ONE + ";", TOOLS)  # a separator with no call after it is text
    assert parsed.content == ";" and len(parsed.calls) == 1


@pytest.mark.parametrize(
    "text",
    [
        'Here is JSON: {"city": "Paris"} and {"name": "Ann", "age": 3}',
        '{"name": "get_time", "parameters": {}}',  # unknown tool
        '{"name": "get_time", "parameters": {"q": {"name": "clock", "parameters": {}}}}',
        '[{"name": "clock", "parameters": {}}, {"name": "get_time", "parameters": {}}]',
        '{"name": "clock", "parameters": {}',  # cut by max_tokens
        '{"name": "get_weather", "parameters": {"city": "Pa',
        '{"name": "clock", "parameters": {},}',
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        "<|python_tag|>",
        "a { b } c {{ d }}",
    ],
)
def test_llama3_not_calls_stay_text(text):
    parsed = LLAMA3.parse(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


# ---- mistral ----


def test_mistral_recorded_outputs():
    one = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    parsed = MISTRAL.parse(one, TOOLS)
    assert parsed.content == "" and calls_of(parsed) == [("get_weather", {"city": "Paris"})]
    several = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"},'
        ' {"name": "clock", "arguments": {}}]'
    )
    assert calls_of(MISTRAL.parse(several, TOOLS)) == [
        ("get_weather", {"city": "Paris"}),
        ("clock", {}),
    ]
    newer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]clock[ARGS]{}'
    parsed = MISTRAL.parse("Let me see. " + newer, TOOLS)
    assert parsed.content == "Let me see." and [c.name for c in parsed.calls] == [
        "get_weather",
        "clock",
    ]
    with_id = "[TOOL_CALLS]clock[CALL_ID]abc123XYZ[ARGS]{}"
    assert calls_of(MISTRAL.parse(with_id, TOOLS)) == [("clock", {})]


@pytest.mark.parametrize(
    "text",
    [
        "The [TOOL_CALLS] token starts a call.",
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "clock", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        "[TOOL_CALLS] []",
        '[TOOL_CALLS] {"name": "clock", "arguments": {}}',  # an object, not a list
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}',  # cut
        '[TOOL_CALLS]get_time[ARGS]{"x": 1}',
        "[TOOL_CALLS]clock[ARGS][]",
        "[TOOL_CALLS]clock[ARGS]{",
    ],
)
def test_mistral_not_calls_stay_text(text):
    parsed = MISTRAL.parse(text, TOOLS)
    assert parsed.calls == [] and parsed.content == text


# ---- streaming ----


def test_stream_holds_back_only_a_possible_trigger():
    stream = HERMES.stream(TOOLS)
    assert stream.feed("Hello <tool") == [ContentDelta("Hello")]  # " <tool" may start a call
    assert stream.feed("box> there") == [ContentDelta(" <toolbox> there")]
    assert stream.feed("\n") == []  # whitespace: dropped if a call follows
    events = stream.feed(QWEN_ONE)
    assert [type(e) for e in events] == [CallStart, ArgumentsDelta]
    assert events[0].name == "get_weather" and events[1].text == '{"city": "Paris", "days": 2}'
    assert stream.feed("\nBye") == [ContentDelta("\nBye")]
    assert stream.finish() == []
    with pytest.raises(ValueError, match="finished"):
        stream.feed("more")


def test_stream_releases_an_unfinished_call_at_the_end():
    stream = LLAMA3.stream(TOOLS)
    assert stream.feed('{"name": "clock", "param') == []
    assert stream.finish() == [ContentDelta('{"name": "clock", "param')]


def fragments(fmt: ToolFormat) -> list[str]:
    call = fmt.call_text("get_weather", {"city": "Paris"})
    return [
        call,
        fmt.call_text("clock", {}),
        fmt.call_text("get_time", {}),
        call[: len(call) // 2],
        call[len(call) // 2 :],
        *fmt.triggers,
        *(t[:2] for t in fmt.triggers),
        '{"name": "clock", ',
        '"arguments": {}}',
        '"parameters": {}}',
        "[ARGS]{}",
        "</tool_call>",
        "\n",
        "  ",
        "; ",
        ";",
        "{",
        "}",
        "[",
        "]",
        '"',
        "\\",
        "Hello",
        "ü",
        "[TOOL_CALLS]clock",
        "<|python_tag|>",
    ]


def texts(fmt: ToolFormat):
    return st.lists(
        st.one_of(st.sampled_from(fragments(fmt)), st.text(max_size=6)), max_size=10
    ).map("".join)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=FORMAT_NAMES)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_adds_up_to_parse(fmt, data):
    text = data.draw(texts(fmt))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    parsed = fmt.parse(text, TOOLS)
    content, calls = streamed(fmt, text, cuts)
    assert content == parsed.content
    assert calls == [(call.name, call.arguments) for call in parsed.calls]
    if not parsed.calls:
        assert parsed.content == text  # nothing taken out: the text as it was


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=FORMAT_NAMES)
@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_arbitrary_text_never_breaks_the_parser(fmt, text):
    parsed = fmt.parse(text, TOOLS)
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert streamed(fmt, text, [len(text) // 3, len(text) // 2])[0] == parsed.content


PLAIN = st.text(
    st.characters(blacklist_characters="<[{;", blacklist_categories=["Cs"]), max_size=12
)
ARGUMENTS = st.fixed_dictionaries(
    {"city": st.text(max_size=8)}, optional={"days": st.integers(-5, 10**12)}
)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=FORMAT_NAMES)
@settings(max_examples=150, deadline=None)
@given(items=st.lists(st.one_of(PLAIN, st.tuples(st.just("get_weather"), ARGUMENTS)), max_size=6))
def test_calls_among_text_are_found(fmt, items):
    text = "\n".join(item if isinstance(item, str) else fmt.call_text(*item) for item in items)
    parsed = fmt.parse(text, TOOLS)
    expected = [item for item in items if not isinstance(item, str)]
    assert calls_of(parsed) == expected
    assert [c.arguments for c in parsed.calls] == [
        json.dumps(args, ensure_ascii=False) for _, args in expected
    ]
    words = [w for item in items if isinstance(item, str) for w in item.split()]
    assert parsed.content.split() == words  # no text lost, none added


BLOCK_HEAVY = """
import sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "xgrammar", "transformers"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Block())
from runtime.constrain.tool_calls import tool_format
from runtime.constrain.reasoning import reasoning_format
tool_format("hermes").structural_tag([], reasoning=reasoning_format("think"))
print("ok")
"""


def test_torch_free():
    root = pathlib.Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_HEAVY], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    allowed = {"__future__", "json", "secrets", "collections", "dataclasses", "regex", "runtime"}
    allowed |= {"abc", "functools", "typing"}  # the tool_calls package's base class, annotations
    constrain = root / "runtime" / "constrain"
    for path in [
        *sorted((constrain / "tool_calls").glob("*.py")),
        constrain / "reasoning.py",
        constrain / "format_names.py",
    ]:
        name = path.relative_to(constrain).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module]
            else:
                continue
            assert {m.split(".")[0] for m in modules} <= allowed, (name, modules)
            if modules[0].startswith("runtime.constrain.tool_calls."):
                continue  # the package's own modules, each checked here
            if modules[0].startswith("runtime"):
                assert modules[0] in (
                    "runtime.protocol",
                    "runtime.constrain.reasoning",
                    "runtime.constrain.check",  # pure Python: the shared depth limit
                    "runtime.constrain.format_names",  # pure Python: names as users write them
                )
