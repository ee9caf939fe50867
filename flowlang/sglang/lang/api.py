"""`sglang.lang.api`: the frontend's functions, as flowlang.sglang exports them."""

from __future__ import annotations

from flowlang.sglang import *  # noqa: F403 - this path re-exports the package's API
from flowlang.sglang import __all__  # noqa: F401
