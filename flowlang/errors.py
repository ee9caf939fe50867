"""flowlang's exceptions: each names the problem and, where it helps, the fix."""

from __future__ import annotations


class FlowlangError(RuntimeError):
    """Base class of flowlang's errors."""


class ProgramError(FlowlangError, ValueError):
    """A program used the language wrongly (bad argument, fork(0), joining twice, ...)."""


class UnknownVariableError(FlowlangError, KeyError):
    """Reading a variable no gen/select of this state defines."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ExecutionError(FlowlangError):
    """A node failed while running (the backend's error is chained)."""


class InvalidOutputError(ExecutionError):
    """A typed gen (schema, gen_int, ...) whose text does not parse: cut by max_new_tokens, or
    otherwise incomplete. The raw text and the parser's error are in the message."""


class InstanceError(FlowlangError):
    """One instance of run_batch failed; carries its exception and traceback text."""

    def __init__(self, index: int, error: BaseException, traceback_text: str) -> None:
        super().__init__(f"instance {index} failed: {error!r}")
        self.index = index
        self.error = error
        self.traceback_text = traceback_text
