"""Reasoning blocks (runtime/constrain/reasoning.py): split whole, split while streaming, and
which format a chat template implies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.constrain.reasoning import (
    REASONING_NAMES,
    ReasoningFormat,
    UnknownReasoningFormat,
    detect_reasoning_format,
    reasoning_format,
)

THINK, R1 = (reasoning_format(name) for name in REASONING_NAMES)


def streamed(fmt: ReasoningFormat, text: str, cuts: list[int], in_reasoning: bool):
    """(reasoning, content) of `text` fed to a stream in pieces cut at `cuts`."""
    stream, pieces, start = fmt.stream(in_reasoning), [], 0
    for cut in [*sorted(cuts), len(text)]:
        pieces += stream.feed(text[start:cut])
        start = max(start, cut)
    pieces += stream.finish()
    assert all(kind in ("reasoning", "content") and piece for kind, piece in pieces)
    reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
    return reasoning, "".join(piece for kind, piece in pieces if kind == "content")


def test_names_and_aliases():
    assert THINK == reasoning_format("qwen3") and THINK.begin == "<think>"
    assert R1 == reasoning_format("deepseek_r1") == reasoning_format("R1")
    assert R1.end == "</think>"
    with pytest.raises(UnknownReasoningFormat, match="unknown reasoning parser 'o1'.*think"):
        reasoning_format("o1")
    assert issubclass(UnknownReasoningFormat, ValueError)


@pytest.mark.parametrize(
    "text, in_reasoning, expected",
    [
        # Qwen3, thinking on: the model opens the block
        (
            "<think>\nThe user greets me.\n</think>\n\nHello!",
            False,
            ("The user greets me.", "Hello!"),
        ),
        # Qwen3, thinking off: an empty block
        ("<think>\n\n</think>\n\nHello!", False, ("", "Hello!")),
        ("Hello!", False, (None, "Hello!")),
        ("\nHello!\n", False, (None, "\nHello!\n")),
        # cut by max_tokens inside the block: all of it is reasoning
        ("<think>\nLet me count: 1, 2, 3", False, ("Let me count: 1, 2, 3", "")),
        ("<think>\nLet me count</thi", False, ("Let me count</thi", "")),
        ("Well. <think>hm</think>ok", False, ("hm", "Well. ok")),
        ("  \n<think>hm</think>\nok", False, ("hm", "ok")),
        # only the first block counts
        ("<think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),
        # DeepSeek-R1: the prompt ended with "<think>\n"
        ("Okay, 2+2 is 4.\n</think>\n\nIt is 4.", True, ("Okay, 2+2 is 4.", "It is 4.")),
        ("\n</think>\n\n4", True, ("", "4")),
        ("still thinking when max_tokens hit", True, ("still thinking when max_tokens hit", "")),
        ("", True, ("", "")),
        ("", False, (None, "")),
        ("inner <think> is text</think>x", True, ("inner <think> is text", "x")),
    ],
)
def test_split(text, in_reasoning, expected):
    for fmt in (THINK, R1):
        assert fmt.split(text, in_reasoning) == expected
        reasoning, content = streamed(fmt, text, list(range(len(text))), in_reasoning)
        assert (reasoning, content) == (expected[0] or "", expected[1])


def test_in_reasoning_from_the_prompt():
    assert R1.in_reasoning("<｜User｜>2+2?<｜Assistant｜><think>\n")
    assert THINK.in_reasoning("<|im_start|>assistant\n<think>\nI was ")
    assert not THINK.in_reasoning("<|im_start|>assistant\n")
    assert not THINK.in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    old_turn = "<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n"
    assert not THINK.in_reasoning(old_turn)
    assert THINK.in_reasoning(old_turn + "<think>\n")


def test_stream_holds_back_only_markers_and_dropped_newlines():
    stream = THINK.stream(in_reasoning=False)
    assert stream.feed("<thi") == []
    assert stream.feed("nk>\n") == []
    assert stream.feed("Let me see") == [("reasoning", "Let me see")]
    assert stream.feed(".\n") == [("reasoning", ".")]  # the newline may come before </think>
    assert stream.feed("More.</") == [("reasoning", "\nMore.")]
    assert stream.feed("think>\n\nHi") == [("content", "Hi")]
    assert stream.feed(" <think>") == [("content", " <think>")]
    assert stream.finish() == []


QWEN3_TEMPLATE_END = (
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}\n{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}{%- endif %}{%- endfor %}" + QWEN3_TEMPLATE_END
)
DEEPSEEK_R1_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{'<｜User｜>' + message['content']}}{% endif %}"
    "{% if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)
QWEN3_THINKING_TEMPLATE = (  # Qwen3-*-Thinking-2507: the prompt opens the block
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
    "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN3_TEMPLATE, "think"),
        (DEEPSEEK_R1_TEMPLATE, "deepseek-r1"),
        (QWEN3_THINKING_TEMPLATE, "deepseek-r1"),
        (CHATML_TEMPLATE, None),
        (None, None),
        ("", None),
    ],
)
def test_detection_from_chat_templates(template, expected):
    assert detect_reasoning_format(template) == expected


MARKER_BITS = ["<think>", "</think>", "<th", "</", "think>", "\n", "\n\n", " ", "a", "ü"]
TEXTS = st.lists(st.one_of(st.sampled_from(MARKER_BITS), st.text(max_size=5)), max_size=14).map(
    "".join
)


@pytest.mark.parametrize("fmt", [THINK, R1], ids=REASONING_NAMES)
@pytest.mark.parametrize("in_reasoning", [False, True])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_adds_up_to_split(fmt, in_reasoning, data):
    text = data.draw(TEXTS)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    reasoning, content = fmt.split(text, in_reasoning)
    assert streamed(fmt, text, cuts, in_reasoning) == (reasoning or "", content)
    if reasoning is None:
        assert content == text
