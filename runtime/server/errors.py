"""Errors over HTTP: each domain error has one status code; anything else is a bug, a 500.

Every error body is {"error": {"message", "type", "code"}}, the shape OpenAI's clients read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from runtime.errors import EngineClosedError, InvalidRequestError, RequestError, UnknownRequestError

if TYPE_CHECKING:
    from runtime.server.state import Server


class BodyTooLargeError(HTTPException):
    """The request body grew past the server's limit while it was read (an HTTPException, so
    FastAPI's body parsing passes it on instead of calling it a parse error)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)

    def __str__(self) -> str:
        return self.detail


class ClientGone(Exception):
    """The client disconnected before its result was ready (the request was aborted)."""


# error -> (status, message); a None message means the error's own
STATUS: dict[type[Exception], tuple[int, str | None]] = {
    InvalidRequestError: (400, None),
    UnknownRequestError: (404, None),
    BodyTooLargeError: (413, None),
    ClientGone: (499, "client closed the request"),
    RequestError: (500, None),
    EngineClosedError: (503, "the server is shutting down"),
}


def error_response(status: int, message: str, server: Server) -> JSONResponse:
    """An error body with `status`, counted in the server's metrics."""
    server.http_errors[status] += 1
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
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
        return error_response(status, message if message is not None else str(err), server)

    return handle


@contextlib.contextmanager
def invalid_input() -> Iterator[None]:
    """Around building protocol objects from a request: a value they reject is a 400."""
    try:
        yield
    except ValidationError as err:
        raise InvalidRequestError(str(err)) from err
