"""What a program state holds (token ids, text, chat messages) and how IR text becomes tokens.

Token ids are the source of truth: text is tokenized one segment at a time and generated
tokens are kept as the engine produced them, so the next request's prompt extends the
previous one exactly and hits the KV cache (re-tokenizing the whole text would not).

Tools: a message with tools shows their definitions as the chat template renders them, or,
for a template that knows no tools, as the "# Tools" section the engine's OpenAI route also
writes (runtime/constrain/tool_prompt.py: the same prompt either way, so the same cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowlang.backends.base import Backend
from flowlang.errors import ProgramError
from flowlang.ir import RoleBegin, RoleEnd, Text, ToolResult
from flowlang.tools import Tool


@dataclass
class Content:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None
    open_role_start: int = 0  # where the open message's content starts in `text`
    open_role_prefix_ids: list[int] = field(default_factory=list)
    num_roles: int = 0
    open_role_tools: tuple[Tool, ...] = ()  # the tools the open message shows
    num_calls: int = 0  # tool calls made so far (numbers their ids: call_0, call_1, ...)

    def copy(self) -> Content:
        """An independent copy (a fork branch continues from it)."""
        return Content(
            list(self.ids),
            self.text,
            [dict(m) for m in self.messages],
            self.open_role,
            self.open_role_start,
            list(self.open_role_prefix_ids),
            self.num_roles,
            self.open_role_tools,
            self.num_calls,
        )

    def append(self, text: str, ids: list[int]) -> None:
        self.text += text
        self.ids.extend(ids)


class Renderer:
    """Turns text and role boundaries into (text, ids) appended to a Content."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def apply(self, content: Content, node: Text | RoleBegin | RoleEnd) -> None:
        """Append a text, role-boundary or tool-result node's tokens."""
        if isinstance(node, ToolResult):  # a Text too: first
            self.tool_result(content, node)
        elif isinstance(node, Text):
            self.text(content, node.text)
        elif isinstance(node, RoleBegin):
            self.role_begin(content, node.role, node.tools)
        else:
            self.role_end(content, node.role)

    def text(self, content: Content, text: str) -> None:
        """Append plain text, tokenized on its own."""
        # the very first segment of plain text gets the tokenizer's BOS, as a prompt would
        ids = self.backend.tokenize(text, add_special_tokens=not content.ids)
        content.append(text, ids)

    def role_begin(self, content: Content, role: str, tools: tuple[Tool, ...] = ()) -> None:
        """Open a `role` message: the template's prefix for it (showing `tools`, if given)."""
        if content.open_role is not None:
            raise ProgramError(
                f"{role!r} message started inside an open {content.open_role!r} "
                f"message; roles do not nest"
            )
        markup = self.backend.chat_format.markup(
            role, first=content.num_roles == 0, tools=self._template_tools(tools)
        )
        ids = self.backend.tokenize(markup.prefix)
        content.append(markup.prefix, ids)
        content.open_role, content.open_role_start = role, len(content.text)
        content.open_role_prefix_ids = ids
        content.open_role_tools = tools
        content.num_roles += 1

    def role_end(self, content: Content, role: str) -> None:
        """Close the open message: the template's suffix; the message is recorded."""
        tools = content.open_role_tools
        if tools and not self.backend.chat_format.supports_tools:
            self.text(content, self._tools_section(content, tools))
        body = content.text[content.open_role_start :]
        markup = self.backend.chat_format.markup(
            role, first=content.num_roles == 1, tools=self._template_tools(tools)
        )
        content.append(markup.suffix, self.backend.tokenize(markup.suffix))
        content.messages.append({"role": role, "content": body})
        content.open_role, content.open_role_tools = None, ()

    def tool_result(self, content: Content, node: ToolResult) -> None:
        """Append tool results as the tool messages that follow the assistant's calls: as the
        template renders role "tool", else one user message of `<tool_response>` blocks."""
        if content.open_role is not None:
            raise ProgramError(
                f"tool results go after the message that made the calls, but the "
                f"{content.open_role!r} message is still open: end it first (`with "
                f"s.assistant(): s += gen('step', tools=...)`, then s.run_tools(s['step']) "
                f"after the with block)"
            )
        messages = [
            {"role": "tool", "content": o.content, "tool_call_id": o.call_id, "name": o.name}
            for o in node.outputs
        ]
        chat_format = self.backend.chat_format
        if chat_format.supports_tools:
            text = chat_format.tool_messages(messages)
        else:
            from runtime.constrain.tool_prompt import tool_response_text  # torch-free

            body = "\n".join(tool_response_text(o.content) for o in node.outputs)
            markup = chat_format.markup("user", first=content.num_roles == 0)
            text = markup.prefix + body + markup.suffix
        content.append(text, self.backend.tokenize(text))
        content.messages.extend(messages)
        content.num_roles += 1

    def _template_tools(self, tools: tuple[Tool, ...]) -> list[dict]:
        """`tools` as the chat template takes them; none when it knows no tools."""
        if not tools or not self.backend.chat_format.supports_tools:
            return []
        from runtime.constrain.tool_prompt import openai_tools  # torch-free

        return openai_tools([t.spec for t in tools])

    def _tools_section(self, content: Content, tools: tuple[Tool, ...]) -> str:
        """The fallback's tool section, after the message's own content if it has some."""
        from runtime.constrain.tool_calls import tool_format
        from runtime.constrain.tool_prompt import tools_block

        block = tools_block([t.spec for t in tools], tool_format(self.backend.tool_format))
        return f"\n\n{block}" if content.text[content.open_role_start :] else block
