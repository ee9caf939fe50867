"""Which tool-call and reasoning formats a served model uses: configured, else read off its
chat template (the Engine and the cluster front answer the same)."""

from __future__ import annotations

from typing import Any

from runtime.config import EngineConfig


def model_tool_format(config: EngineConfig, tokenizer: Any) -> str:
    """How the model writes tool calls (a name in runtime.constrain.tool_calls.FORMAT_NAMES)."""
    from runtime.constrain.tool_calls import detect_tool_format

    return config.tool_call_parser or detect_tool_format(getattr(tokenizer, "chat_template", None))


def model_reasoning_format(config: EngineConfig, tokenizer: Any) -> str | None:
    """How the model writes its reasoning (runtime.constrain.reasoning), or None."""
    from runtime.constrain.reasoning import detect_reasoning_format

    if config.reasoning_parser == "none":
        return None
    template = getattr(tokenizer, "chat_template", None)
    return config.reasoning_parser or detect_reasoning_format(template)
