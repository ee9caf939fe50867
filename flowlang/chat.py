"""Role markup from the model's own chat template (Hugging Face jinja), one message at a time.

Programs add messages incrementally (and generate inside them), so the template is rendered
around a sentinel content to learn each role's prefix and suffix: as the first message (where
templates add BOS or a default system prompt) and as a later one.
"""

from __future__ import annotations

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
        self._template = env.from_string(template)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._markups: dict[tuple[str, bool], RoleMarkup] = {}

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template applied to whole `messages`."""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self._tokens
        )

    def markup(self, role: str, first: bool) -> RoleMarkup:
        """The text the template puts before and after a `role` message's content."""
        key = (role, first)
        if key not in self._markups:
            self._markups[key] = self._derive(role, first)
        return self._markups[key]

    def _derive(self, role: str, first: bool) -> RoleMarkup:
        try:
            if first:
                before, rendered = "", self.render([{"role": role, "content": _SENTINEL}])
            else:
                other = "user" if role != "user" else "assistant"
                opener = [{"role": other, "content": "x"}]
                before = self.render(opener)
                rendered = self.render([*opener, {"role": role, "content": _SENTINEL}])
        except jinja2.TemplateError as err:
            raise ProgramError(f"the chat template rejects a {role!r} message here: {err}") from err
        if not rendered.startswith(before) or _SENTINEL not in rendered:
            raise ProgramError(f"cannot derive {role!r} markup from this chat template")
        prefix, suffix = rendered[len(before) :].split(_SENTINEL)
        return RoleMarkup(prefix, suffix)
