"""The engine's domain errors: what a caller (in-process or over HTTP) may be told.

The server maps each to one status code (runtime/server/errors.py); anything else is a bug and
becomes a 500, never a client error. `UsageError` is the one kind raised before any request:
a mistake in how the engine was started.
"""

from __future__ import annotations

from runtime.protocol import GenerateResult


class UsageError(Exception):
    """A mistake in how the engine was started (a model name, a file, a setting, a port), not a
    bug: the message says what to do, and the `flowlang` command prints it without a traceback."""


class InvalidRequestError(ValueError):
    """A request the engine refuses before running it; the message names the problem."""


class UnknownRequestError(KeyError):
    """A request or pin id the engine does not know (never submitted, or already finished)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown request"


class EngineClosedError(RuntimeError):
    """The engine was closed; it accepts nothing more."""


class RequestError(RuntimeError):
    """A request that failed while running (the engine itself keeps serving)."""


class EngineBusyError(RuntimeError):
    """The engine cannot take this request now (its memory is held by pins and running
    requests); the same request may succeed later."""

    retry_after_s = 5


class RequestTimeoutError(RequestError):
    """The request ran past its deadline (`timeout_s`) and was stopped."""


def error_of(result: GenerateResult) -> Exception:
    """The domain error a failed result stands for (finish_reason "error")."""
    return error_for_kind(result.error_kind, result.error or "generation failed")


def error_for_kind(kind: str | None, message: str) -> Exception:
    """The domain error for a request that failed with `kind` ("invalid", "busy", ...)."""
    if kind == "busy":
        return EngineBusyError(message)
    if kind == "internal":
        return RequestError(message)
    if kind == "timeout":
        return RequestTimeoutError(message)
    return InvalidRequestError(message)
