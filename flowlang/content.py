"""What a program state holds (token ids, text, chat messages) and how IR text becomes tokens.

Token ids are the source of truth: text is tokenized one segment at a time and generated
tokens are kept as the engine produced them, so the next request's prompt extends the
previous one exactly and hits the KV cache (re-tokenizing the whole text would not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowlang.backends.base import Backend
from flowlang.errors import ProgramError
from flowlang.ir import RoleBegin, RoleEnd, Text


@dataclass
class Content:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    open_role: str | None = None
    open_role_start: int = 0  # where the open message's content starts in `text`
    open_role_prefix_ids: list[int] = field(default_factory=list)
    num_roles: int = 0

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
        )

    def append(self, text: str, ids: list[int]) -> None:
        self.text += text
        self.ids.extend(ids)


class Renderer:
    """Turns text and role boundaries into (text, ids) appended to a Content."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def apply(self, content: Content, node: Text | RoleBegin | RoleEnd) -> None:
        """Append a text or role-boundary node's tokens."""
        if isinstance(node, Text):
            self.text(content, node.text)
        elif isinstance(node, RoleBegin):
            self.role_begin(content, node.role)
        else:
            self.role_end(content, node.role)

    def text(self, content: Content, text: str) -> None:
        """Append plain text, tokenized on its own."""
        # the very first segment of plain text gets the tokenizer's BOS, as a prompt would
        ids = self.backend.tokenize(text, add_special_tokens=not content.ids)
        content.append(text, ids)

    def role_begin(self, content: Content, role: str) -> None:
        """Open a `role` message: the template's prefix for it."""
        if content.open_role is not None:
            raise ProgramError(
                f"{role!r} message started inside an open {content.open_role!r} "
                f"message; roles do not nest"
            )
        markup = self.backend.chat_format.markup(role, first=content.num_roles == 0)
        ids = self.backend.tokenize(markup.prefix)
        content.append(markup.prefix, ids)
        content.open_role, content.open_role_start = role, len(content.text)
        content.open_role_prefix_ids = ids
        content.num_roles += 1

    def role_end(self, content: Content, role: str) -> None:
        """Close the open message: the template's suffix; the message is recorded."""
        body = content.text[content.open_role_start :]
        markup = self.backend.chat_format.markup(role, first=content.num_roles == 1)
        content.append(markup.suffix, self.backend.tokenize(markup.suffix))
        content.messages.append({"role": role, "content": body})
        content.open_role = None
