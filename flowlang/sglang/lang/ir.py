"""`sglang.lang.ir`'s public constants: the regexes SGLang programs build constraints from."""

from __future__ import annotations

from flowlang.sglang.expr import BOOL_REGEX, FLOAT_REGEX, INT_REGEX, STR_REGEX

REGEX_INT = INT_REGEX
REGEX_FLOAT = FLOAT_REGEX
REGEX_BOOL = BOOL_REGEX
REGEX_STR = STR_REGEX

__all__ = ["REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR"]
