"""What a chat template says of tools: the family it writes calls in, and whether it renders
the tools at all (else they are taught in a message: runtime/constrain/tool_prompt.py)."""

from __future__ import annotations

import regex

_JINJA_CODE = regex.compile(r"\{\{.*?\}\}|\{%.*?%\}", regex.S)
_TOOLS_WORD = regex.compile(r"\btools\b")
_STRING_LITERAL = regex.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", regex.S)


def detect_tool_format(chat_template: str | None) -> str:
    """The tool call format a chat template writes; "hermes" when it shows none."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3"
    return "hermes"


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders a `tools` variable (in a jinja expression or statement)."""
    return any(
        _TOOLS_WORD.search(_STRING_LITERAL.sub("", code.group()))
        for code in _JINJA_CODE.finditer(chat_template or "")
    )
