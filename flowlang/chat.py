"""Role markup from the model's own chat template (Hugging Face jinja), one message at a time.

Programs add messages incrementally (and generate inside them), so the template is rendered
around a sentinel content to learn each role's prefix and suffix: as the first message (where
templates add BOS or a default system prompt) and as a later one. A message that shows tools is
derived with the tools passed to the template (as Hugging Face templates take them); tool
results are rendered whole, as the tool messages that follow an assistant's calls.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from flowlang.errors import ProgramError

_SENTINEL = "\x00FLOWLANG\x00"
# ChatML: what MockBackend uses, and SmolLM2's format without its default system prompt
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class RoleMarkup:
    prefix: str
    suffix: str


class ChatFormat:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = "") -> None:
        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = raise_exception
        self.template = template
        self._template = env.from_string(template)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._markups: dict[tuple[str, bool, str], RoleMarkup] = {}

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the template renders tool definitions (its `tools` variable)."""
        from runtime.constrain.tool_calls import template_supports_tools  # torch-free

        return template_supports_tools(self.template)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = False,
        tools: Sequence[dict] | None = None,
    ) -> str:
        """The template applied to whole `messages` (`tools`: OpenAI-style definitions)."""
        extra = {"tools": list(tools)} if tools else {}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self._tokens,
            **extra,
        )

    def markup(self, role: str, first: bool, tools: Sequence[dict] = ()) -> RoleMarkup:
        """The text the template puts before and after a `role` message's content; with
        `tools`, of the message that shows them (the template must support tools)."""
        key = (role, first, json.dumps(list(tools), sort_keys=True))
        if key not in self._markups:
            self._markups[key] = self._derive(role, first, list(tools))
        return self._markups[key]

    def tool_messages(self, messages: list[dict]) -> str:
        """The text of tool-result `messages` (role "tool", with tool_call_id and name) after
        an assistant message that made those calls, as the template renders them."""
        calls = [
            {
                "id": m["tool_call_id"],
                "type": "function",
                "function": {"name": m["name"], "arguments": {}},
            }
            for m in messages
        ]
        opener = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": calls},
        ]
        try:
            before = self.render(opener)
            rendered = self.render([*opener, *messages])
        except jinja2.TemplateError as err:
            raise ProgramError(f"the chat template rejects tool results here: {err}") from err
        if not rendered.startswith(before):
            raise ProgramError("cannot render tool results with this chat template")
        return rendered[len(before) :]

    def _derive(self, role: str, first: bool, tools: list[dict]) -> RoleMarkup:
        try:
            if first:
                before = ""
                rendered = self.render([{"role": role, "content": _SENTINEL}], tools=tools)
            else:
                other = "user" if role != "user" else "assistant"
                opener = [{"role": other, "content": "x"}]
                before = self.render(opener, tools=tools)
                rendered = self.render([*opener, {"role": role, "content": _SENTINEL}], tools=tools)
        except jinja2.TemplateError as err:
            raise ProgramError(f"the chat template rejects a {role!r} message here: {err}") from err
        if not rendered.startswith(before) or _SENTINEL not in rendered:
            raise ProgramError(f"cannot derive {role!r} markup from this chat template")
        prefix, suffix = rendered[len(before) :].split(_SENTINEL)
        missing = [
            t["function"]["name"] for t in tools if t["function"]["name"] not in prefix + suffix
        ]
        if missing:  # the template puts tools somewhere else (the conversation's start)
            raise ProgramError(
                f"this chat template does not show tools {missing} in a "
                f"{'first' if first else 'later'} {role!r} message; pass tools= to the message "
                f"where it shows them (for most templates the conversation's first message: "
                f"system(..., tools=...))"
            )
        return RoleMarkup(prefix, suffix)
