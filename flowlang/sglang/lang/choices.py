"""`sglang.lang.choices`: the select methods, as flowlang.sglang exports them."""

from __future__ import annotations

from flowlang.sglang import (
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

__all__ = [
    "ChoicesSamplingMethod",
    "greedy_token_selection",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
]
