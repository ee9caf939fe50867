"""The structural tags of runtime/constrain/tool_calls.py, compiled by xgrammar against the
default model's tokenizer: what each family's tag accepts and refuses, and that every call
the grammar lets through parses back into a call whose arguments fit the tool's schema."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from runtime.constrain.reasoning import detect_reasoning_format, reasoning_format
from runtime.constrain.tool_calls import (
    FORMAT_NAMES,
    ArgumentsDelta,
    InvalidTools,
    answer_after_reasoning,
    detect_tool_format,
    template_supports_tools,
    tool_format,
)
from runtime.protocol import ToolSpec

xgr = pytest.importorskip("xgrammar")

VOCAB_SIZE, EOS = 49152, 2
WEATHER = ToolSpec(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
CLOCK = ToolSpec(name="clock")
SEARCH = ToolSpec(
    name="search",
    parameters={
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 12},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50},
            "exact": {"type": "boolean"},
            "mode": {"enum": ["fast", "deep"]},
            "weights": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
            "filter": {
                "type": "object",
                "properties": {"lang": {"type": "string", "maxLength": 4}},
                "required": ["lang"],
            },
        },
        "required": ["query", "limit"],
    },
)
TOOLS = [WEATHER, CLOCK]
FORMATS = [tool_format(name) for name in FORMAT_NAMES]
THINK = reasoning_format("think")
ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
    },
}


@pytest.fixture(scope="module")
def compiler(default_tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(
        default_tokenizer, vocab_size=VOCAB_SIZE, stop_token_ids=[EOS]
    )
    return xgr.GrammarCompiler(info, max_threads=1)


def matcher(compiler, tag: dict):
    return xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))


def accepts(compiler, tag: dict, text: str) -> bool:
    """The tag takes all of `text` and may end there."""
    m = matcher(compiler, tag)
    return m.accept_string(text) and m.accept_token(EOS) and m.is_terminated()


def starts(compiler, tag: dict, text: str) -> bool:
    """The tag takes `text` as (the start of) an output."""
    return matcher(compiler, tag).accept_string(text)


def paris(fmt):
    return fmt.call_text("get_weather", {"city": "Paris"})


def two_calls(fmt):
    return fmt.calls_text([("get_weather", {"city": "Paris", "days": 2}), ("clock", {})])


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("choice", ["auto", "required", "get_weather"])
def test_a_correct_call_is_accepted(compiler, fmt, choice):
    tag = fmt.structural_tag(TOOLS, choice=choice)
    assert accepts(compiler, tag, paris(fmt))
    assert accepts(compiler, tag, fmt.call_text("get_weather", {"city": "Zürich 東京 🌧"}))
    if choice == "get_weather":
        assert not starts(compiler, tag, two_calls(fmt))  # a named tool: one call
    else:
        assert accepts(compiler, tag, two_calls(fmt))
        assert accepts(compiler, tag, fmt.call_text("clock", {}))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("choice", ["auto", "required", "get_weather"])
@pytest.mark.parametrize(
    "name, arguments",
    [
        ("get_wether", {"city": "Paris"}),  # no such tool
        ("get_weather", {"city": 3}),  # a wrong type
        ("get_weather", {"days": 3}),  # a required property missing
        ("get_weather", {"city": "Paris", "country": "FR"}),  # one not in the schema
        ("get_weather", {"city": "Paris", "days": 1.5}),
        ("get_weather", ["Paris"]),  # arguments that are no object
    ],
)
def test_a_wrong_call_is_rejected(compiler, fmt, choice, name, arguments):
    tag = fmt.structural_tag(TOOLS, choice=choice)
    assert not accepts(compiler, tag, fmt.call_text(name, arguments))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_free_text_only_where_calls_are_optional(compiler, fmt):
    text = "The weather is fine, no tool needed."
    auto = fmt.structural_tag(TOOLS)
    assert accepts(compiler, auto, text)
    assert accepts(compiler, auto, text + "\n" + paris(fmt) + "\nDone.")
    assert accepts(compiler, auto, "")
    for choice in ("required", "get_weather"):
        assert not starts(compiler, fmt.structural_tag(TOOLS, choice=choice), "The")
        assert not accepts(compiler, fmt.structural_tag(TOOLS, choice=choice), "")
    # required: text may follow the calls (not come before them)
    assert accepts(compiler, fmt.structural_tag(TOOLS, choice="required"), paris(fmt) + " ok")
    none = fmt.structural_tag(TOOLS, choice="none")
    assert accepts(compiler, none, text)
    assert accepts(compiler, fmt.structural_tag([]), text)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_not_parallel_stops_after_one_call(compiler, fmt, choice):
    tag = fmt.structural_tag(TOOLS, choice=choice, parallel=False)
    assert accepts(compiler, tag, paris(fmt))
    assert not starts(compiler, tag, two_calls(fmt))
    if choice == "auto":
        assert accepts(compiler, tag, "Let me check. " + paris(fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
@pytest.mark.parametrize("choice", ["auto", "required", "get_weather"])
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_reasoning_then_the_call(compiler, fmt, choice, in_reasoning):
    tag = fmt.structural_tag(TOOLS, choice=choice, reasoning=THINK, in_reasoning=in_reasoning)
    thought = "The user wants the weather {in Paris}.\n</think>\n\n"
    opened = thought if in_reasoning else "<think>\n" + thought
    assert accepts(compiler, tag, opened + paris(fmt))
    assert accepts(compiler, tag, opened.replace("\n\n", "") + paris(fmt))
    assert not accepts(compiler, tag, opened + "<think>" + paris(fmt))  # one block only
    assert not starts(compiler, tag, opened.replace("wants", "<think> wants"))
    # the block is optional unless the prompt opened it
    assert accepts(compiler, tag, paris(fmt)) is not in_reasoning
    if choice == "auto":
        assert accepts(compiler, tag, opened + "It is sunny.")
    else:
        assert not starts(compiler, tag, opened + "It is sunny.")


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_an_answer_schema_after_reasoning(compiler, in_reasoning):
    opened = "" if in_reasoning else "<think>\n"
    tag = answer_after_reasoning(ANSWER, THINK, in_reasoning)
    assert accepts(compiler, tag, opened + "6 times 7.\n</think>\n\n" + '{"answer": 42}')
    assert accepts(compiler, tag, opened + "</think>" + '{"answer": 42}')
    assert not starts(compiler, tag, opened + "6 times 7.</think>\n\nIt is 42")
    assert not accepts(compiler, tag, opened + '6 times 7.</think>{"answer": "42"}')
    assert not starts(compiler, tag, opened + '{"answer": 42}</think>x')
    # the same through structural_tag: no tools, an answer
    hermes = tool_format("hermes")
    same = hermes.structural_tag([], reasoning=THINK, in_reasoning=in_reasoning, answer=ANSWER)
    assert same == tag
    assert accepts(compiler, hermes.structural_tag([], answer=ANSWER), '{"answer": 1}')


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_an_answer_schema_or_calls(compiler, fmt):
    tag = fmt.structural_tag(TOOLS, answer=ANSWER)
    assert accepts(compiler, tag, '{"answer": 42}')
    assert accepts(compiler, tag, paris(fmt))
    assert not starts(compiler, tag, "Hello")


@pytest.mark.parametrize(
    "tools, choice, message",
    [
        ([], "required", "'required' needs at least one tool"),
        (TOOLS, "get_time", "'get_time' names no given tool"),
        ([], "get_time", "'get_time' names no given tool"),
        ([ToolSpec.model_construct(name="bad name", parameters={})], "auto", "'bad name'"),
        ([ToolSpec.model_construct(name="", parameters={})], "auto", "tool name ''"),
        ([CLOCK, CLOCK], "auto", "'clock' is given twice"),
        ([ToolSpec(name="f", parameters={"type": "string"})], "auto", "must be an object"),
    ],
)
def test_what_no_grammar_is_built_for(tools, choice, message):
    for fmt in FORMATS:
        with pytest.raises(InvalidTools, match=message):
            fmt.structural_tag(tools, choice=choice)
    assert issubclass(InvalidTools, ValueError)


def test_parameters_without_a_type_are_an_object(compiler):
    loose = ToolSpec(name="loose", parameters={"properties": {"x": {"type": "integer"}}})
    for fmt in FORMATS:
        tag = fmt.structural_tag([loose], choice="loose")
        assert accepts(compiler, tag, fmt.call_text("loose", {"x": 1}))
        assert not accepts(compiler, tag, fmt.call_text("loose", {"x": "one"}))


def test_the_default_models_template(default_tokenizer):
    template = default_tokenizer.chat_template
    assert detect_tool_format(template) == "hermes"  # plain ChatML: the fallback
    assert not template_supports_tools(template)
    assert detect_reasoning_format(template) is None


def walk(compiled, rng: random.Random, blocked: np.ndarray, tokenizer, steps: int = 400):
    """A random output the grammar allows (EOS taken whenever allowed, mostly), or None."""
    m = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    ids = []
    for _ in range(steps):
        m.fill_next_token_bitmask(bitmask)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE]
        allowed = allowed.astype(bool) & ~blocked
        token = EOS if allowed[EOS] and rng.random() < 0.8 else rng.choice(np.flatnonzero(allowed))
        assert m.accept_token(int(token))
        if token == EOS:
            assert m.is_terminated()
            return tokenizer.decode(ids)
        ids.append(int(token))
    return None


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_NAMES)
def test_whatever_the_grammar_accepts_parses_back(compiler, default_tokenizer, fmt):
    blocked = np.zeros(VOCAB_SIZE, dtype=bool)  # special tokens but EOS, as GrammarCache does
    for token_id, token in default_tokenizer.added_tokens_decoder.items():
        blocked[token_id] = token.special and token_id != EOS
    tools, schemas = [SEARCH, WEATHER, CLOCK], {t.name: t.parameters for t in (SEARCH, WEATHER)}
    rng, seen, finished = random.Random(FORMAT_NAMES.index(fmt.name)), set(), 0
    for choice, parallel in [("search", True), ("required", False), ("required", True)] * 8:
        compiled = compiler.compile_structural_tag(
            json.dumps(fmt.structural_tag(tools, choice=choice, parallel=parallel))
        )
        text = walk(compiled, rng, blocked, default_tokenizer)
        if text is None:
            continue
        finished += 1
        parsed = fmt.parse(text, tools)
        assert parsed.calls, text
        if not parallel:
            assert len(parsed.calls) == 1 and parsed.content == "", text
        for call in parsed.calls:
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, schemas.get(call.name, CLOCK.parameters))
            seen.add(call.name)
        stream = fmt.stream(tools)
        events = [e for piece in text for e in stream.feed(piece)] + stream.finish()
        assert [e.text for e in events if isinstance(e, ArgumentsDelta)] == [
            call.arguments for call in parsed.calls
        ]
    assert finished >= 16 and "search" in seen
