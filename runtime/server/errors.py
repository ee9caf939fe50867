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

from runtime.errors import (
    EngineBusyError,
    EngineClosedError,
    InvalidRequestError,
    RequestError,
    UnknownRequestError,
)

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


# error -> (status, message); a None message means the error's own
STATUS: dict[type[Exception], tuple[int, str | None]] = {
    InvalidRequestError: (400, None),
    UnknownRequestError: (404, None),
    BodyReadTimeoutError: (408, None),
    BodyTooLargeError: (413, None),
    TooManyRequestsError: (429, None),
    ClientGone: (499, "client closed the request"),
    RequestError: (500, None),
    EngineBusyError: (503, None),
    EngineClosedError: (503, "the server is shutting down"),
}


def error_response(
    status: int, message: str, server: Server, retry_after_s: int | None = None
) -> JSONResponse:
    """An error body with `status` (and a Retry-After hint), counted in the metrics."""
    server.http_errors[status] += 1
    kind = "invalid_request_error" if status < 500 else "server_error"
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return AsciiJSONResponse(
        {"error": {"message": message, "type": kind, "code": status}},
        status_code=status,
        headers=headers,
    )


def install_error_handlers(app: FastAPI, server: Server) -> None:
    """Map the domain errors, request validation (422) and any other exception (500)."""
    for kind, (status, message) in STATUS.items():
        app.add_exception_handler(kind, _handler(server, status, message))

    async def validation(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(422, f"invalid request: {problems}", server)

    app.add_exception_handler(RequestValidationError, validation)
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
