"""Errors over HTTP: each domain error has one status code; anything else is a bug, a 500.

Every error body is {"error": {"message", "type", "code"}}, the shape OpenAI's clients read.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.errors import (
    EngineBusyError,
    EngineClosedError,
    InvalidRequestError,
    RequestError,
    RequestTimeoutError,
    UnknownRequestError,
    error_of,
)
from runtime.protocol import GenerateResult

if TYPE_CHECKING:
    from runtime.server.state import Server


class BodyTooLargeError(HTTPException):
    """The request body grew past the server's limit while it was read (an HTTPException, so
    FastAPI's body parsing passes it on instead of calling it a parse error)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)

    def __str__(self) -> str:
        return self.detail


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: text a client sent (a lone surrogate in an id, say) can be
    echoed back without failing to encode the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


class TooManyRequestsError(Exception):
    """An API key is over one of its limits (concurrent requests, pinned tokens)."""

    retry_after_s = 1


class BodyReadTimeoutError(HTTPException):
    """The client sent its body too slowly (a slow-loris connection holds a worker)."""

    def __init__(self, message: str) -> None:
        super().__init__(408, message)

    def __str__(self) -> str:
        return self.detail


class ClientGone(Exception):
    """The client disconnected before its result was ready (the request was aborted)."""


class ShuttingDownError(Exception):
    """The server is shutting down: it takes no new request, and one still running when the
    drain's grace period ended was stopped (runtime/server/drain.py)."""

    retry_after_s = 5  # about a restart; a balancer sends the retry to another instance


# error -> (status, message); a None message means the error's own
STATUS: dict[type[Exception], tuple[int, str | None]] = {
    InvalidRequestError: (400, None),
    UnknownRequestError: (404, None),
    BodyReadTimeoutError: (408, None),
    RequestTimeoutError: (408, None),
    BodyTooLargeError: (413, None),
    TooManyRequestsError: (429, None),
    ClientGone: (499, "client closed the request"),
    RequestError: (500, None),
    EngineBusyError: (503, None),
    EngineClosedError: (503, "the server is shutting down"),
    ShuttingDownError: (503, None),
}


def error_body(status: int, message: str) -> dict:
    """The error shape of every API, in responses and in stream frames alike."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(
    status: int,
    message: str,
    server: Server,
    retry_after_s: int | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error body with `status` (and a Retry-After hint), counted in the metrics."""
    server.http_errors[status] += 1
    headers = dict(headers or {})
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    return AsciiJSONResponse(error_body(status, message), status_code=status, headers=headers)


def status_of(err: Exception) -> int:
    """The status code of a domain error (500 for anything else)."""
    return next((STATUS[kind][0] for kind in type(err).__mro__ if kind in STATUS), 500)


def failure_of(result: GenerateResult) -> Exception | None:
    """The error a finished result stands for, or None if it did not fail. A request past
    its deadline ends as an abort of kind "timeout" (a client's abort is no failure)."""
    if result.finish_reason == "error" or result.error_kind == "timeout":
        return error_of(result)
    return None


def error_frame(err: Exception) -> str:
    """A stream's last data frame when its request failed (OpenAI's client raises on it)."""
    return json.dumps(error_body(status_of(err), str(err)))


def install_error_handlers(app: FastAPI, server: Server) -> None:
    """Map the domain errors, request validation (422) and any other exception (500)."""
    for kind, (status, message) in STATUS.items():
        app.add_exception_handler(kind, _handler(server, status, message))

    async def validation(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(422, f"invalid request: {problems}", server)

    app.add_exception_handler(RequestValidationError, validation)

    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # 404, 405, and FastAPI's 400 for a body it cannot decode (not UTF-8, say)
        message = str(err.detail)
        if err.__cause__ is not None:
            message = f"{message}: {err.__cause__}"
        return error_response(err.status_code, message, server, headers=err.headers)

    app.add_exception_handler(StarletteHTTPException, http_error)
    # a stray exception (KeyError, ValueError, ...) is a server bug, never the client's fault;
    # Starlette still re-raises it after this response, so it is logged with its traceback
    app.add_exception_handler(Exception, _handler(server, 500, "internal server error"))


def _handler(
    server: Server, status: int, message: str | None
) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
    async def handle(request: Request, err: Exception) -> JSONResponse:
        text = message if message is not None else str(err)
        return error_response(status, text, server, getattr(err, "retry_after_s", None))

    return handle


@contextlib.contextmanager
def invalid_input() -> Iterator[None]:
    """Around building protocol objects from a request: a value they reject is a 400."""
    try:
        yield
    except ValidationError as err:
        raise InvalidRequestError(str(err)) from err
