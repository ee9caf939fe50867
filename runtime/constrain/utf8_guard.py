"""Constrained output is valid UTF-8: what xgrammar lets through that is not.

xgrammar (0.2.9) accepts the UTF-8-style encodings of surrogates (U+D800-DFFF: the bytes ED,
A0-BF, 80-BF) inside JSON strings and character classes. They are not UTF-8: decoded, each
byte becomes U+FFFD, so a string the grammar bounds (`maxLength: 1`) reads back as three
characters and a tool call fails its own schema (found by tests/test_openai_tools.py's
generated schemas). The guard keeps them out of every constrained row: a token that holds such
a sequence never, and after a token that ends on a bare ED lead byte, no token that starts
with A0-BF (ED 80-9F, the valid U+D000-D7FF, stays allowed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SURROGATE_LEAD = 0xED
SURROGATE_SECOND = range(0xA0, 0xC0)  # after ED: A0-BF encode U+D800-DFFF


class Utf8Guard:
    """Per token of a vocabulary (its bytes, `decoded_vocab`): what the guard blocks."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int) -> None:
        self.never = torch.zeros(vocab_size, dtype=torch.bool)  # holds ED A0-BF
        self.after_lead = torch.zeros(vocab_size, dtype=torch.bool)  # starts with A0-BF
        self._ends_on_lead: set[int] = set()  # ends with a bare ED
        for token_id, raw in enumerate(decoded_vocab[:vocab_size]):
            if not raw:
                continue
            if raw[0] in SURROGATE_SECOND:
                self.after_lead[token_id] = True
            if raw[-1] == SURROGATE_LEAD:
                self._ends_on_lead.add(token_id)
            at = raw.find(bytes([SURROGATE_LEAD]))
            while at != -1 and at + 1 < len(raw):
                if raw[at + 1] in SURROGATE_SECOND:
                    self.never[token_id] = True
                    break
                at = raw.find(bytes([SURROGATE_LEAD]), at + 1)

    def ends_on_lead(self, token_id: int | None) -> bool:
        """Whether the next token would continue a sequence that `token_id` began with ED."""
        return token_id in self._ends_on_lead
