"""Registered programs as routes: `POST /v1/flowlang/programs/{name}` runs one with its
arguments as the JSON body, and batch files may name the same url (one line, one run).

Arguments are checked against the program function's annotations with pydantic, so a
program taking dataclasses or models takes their JSON; a missing, unknown or ill-typed
argument is a 400 naming it. The answer: the run's variables and return value, as JSON."""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import time
import typing
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request  # at module level: FastAPI resolves the route's annotations here
from pydantic import TypeAdapter, ValidationError

from flowlang.backends.base import Backend
from flowlang.batch import batch_instance
from flowlang.batch_results import jsonable
from flowlang.program import Program
from runtime.errors import InvalidRequestError, UsageError

PROGRAMS_URL = "/v1/flowlang/programs"
MAX_PROGRAM_THREADS = 256  # programs in flight at once: each waits on its requests in a thread


class ArgumentError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ProgramRoute:
    """One registered program: its arguments checked, run on `backend`, answered as JSON."""

    def __init__(self, program: Program, backend: Backend, pool: ThreadPoolExecutor) -> None:
        self.program = program
        self.backend = backend
        self.pool = pool
        self.url = f"{PROGRAMS_URL}/{program.name}"
        self.namespace: str | None = None  # a tenant's cache salt (for_tenant)

    def for_tenant(self, headers: Mapping[str, str], namespace: str | None) -> ProgramRoute:
        """This route for one tenant's batch: its runs and pins under the tenant's namespace."""
        route = ProgramRoute(self.program, self.backend, self.pool)
        route.namespace = namespace
        return route

    @functools.cached_property
    def _params(self) -> dict[str, tuple[inspect.Parameter, TypeAdapter]]:
        fn = self.program.fn
        hints = typing.get_type_hints(fn)
        params = list(inspect.signature(fn).parameters.values())[1:]  # after the state `s`
        return {p.name: (p, TypeAdapter(hints.get(p.name, Any))) for p in params}

    def arguments(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The body as the function's keyword arguments; ArgumentError names what is wrong."""
        unknown = sorted(set(body) - set(self._params))
        if unknown:
            raise ArgumentError(unknown[0], f"{self.program.name} takes no argument {unknown[0]!r}")
        args = {}
        for name, (param, adapter) in self._params.items():
            if name not in body:
                if param.default is inspect.Parameter.empty:
                    raise ArgumentError(name, f"{self.program.name}: argument {name!r} is missing")
                continue
            try:
                args[name] = adapter.validate_python(body[name])
            except ValidationError as err:
                first = err.errors()[0]
                where = ".".join(str(p) for p in (name, *first["loc"]))
                raise ArgumentError(name, f"{where}: {first['msg']}") from err
        return args

    def prompt(self, body: Mapping[str, Any]) -> tuple[str | None, list[int]] | None:
        """The run's first prompt (compiled, not generated), for the batch's shared pins."""
        try:
            graph = self.program.compile(backend=self.backend, **self.arguments(body))
        except (ArgumentError, ValueError, TypeError):
            return None  # the run answers it with its error
        prefix = batch_instance(graph).prefix_ids
        return (self.namespace, list(prefix)) if prefix else None

    def answer(
        self, body: Mapping[str, Any], namespace: str | None, priority: int = 0
    ) -> tuple[int, dict]:
        """(status, JSON body) of one run at `priority` (higher first); blocking."""
        try:
            args = self.arguments(body)
        except ArgumentError as err:
            return 400, _error(str(err), "invalid_request_error", err.param)
        try:
            state = self.program.run(
                backend=self.backend, namespace=namespace, priority=priority, **args
            )
            variables = {k: jsonable(v, k) for k, v in state.variables().items()}
            returned = jsonable(state.return_value, "return value")
        except Exception as err:  # noqa: BLE001 - the program's own failure is its answer
            return 500, _error(f"{type(err).__name__}: {err}", "program_error")
        run_id = f"prog-{uuid.uuid4().hex}"
        return 200, {
            "id": run_id,
            "object": "flowlang.program.run",
            "created": int(time.time()),
            "program": self.program.name,
            "variables": variables,
            "return_value": returned,
        }

    async def run(self, line: Any) -> tuple[int, dict]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self.answer, line.body, self.namespace)


def _error(message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class ProgramRoutes:
    """The registered programs by url, running on one backend with their own threads."""

    def __init__(self, programs: Iterable[Program], backend: Backend) -> None:
        self.pool = ThreadPoolExecutor(MAX_PROGRAM_THREADS, thread_name_prefix="program")
        self.routes = {p.url: p for p in (ProgramRoute(q, backend, self.pool) for q in programs)}

    def router(self):
        """`POST /v1/flowlang/programs/{name}` (and the list at GET /v1/flowlang/programs)."""
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        from runtime.server.agent_hints import run_priority

        router = APIRouter()
        by_name = {r.program.name: r for r in self.routes.values()}

        @router.get(PROGRAMS_URL)
        async def list_programs():
            return {
                "object": "list",
                "data": [{"name": n, "url": PROGRAMS_URL + "/" + n} for n in by_name],
            }

        @router.post(PROGRAMS_URL + "/{name}")
        async def run_program(name: str, request: Request):
            route = by_name.get(name)
            if route is None:
                known = ", ".join(sorted(by_name)) or "none"
                return JSONResponse(
                    _error(
                        f"no program {name!r} (registered: {known})",
                        "invalid_request_error",
                        "name",
                    ),
                    404,
                )
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                return JSONResponse(
                    _error("the body must be a JSON object of arguments", "invalid_request_error"),
                    400,
                )
            try:
                priority = run_priority(request)
            except InvalidRequestError as err:
                return JSONResponse(_error(str(err), "invalid_request_error", "headers"), 400)
            namespace = request.app.state.server.namespace(request, None)
            loop = asyncio.get_running_loop()
            run = functools.partial(route.answer, body, namespace, priority)
            status, answer = await loop.run_in_executor(self.pool, run)
            return JSONResponse(answer, status)

        return router


def program_extension(programs: Iterable[Program]):
    """The server extension serving `programs` (runtime.server.extensions.AppExtension)."""
    from flowlang.backends.local import LocalBackend
    from runtime.server.extensions import AppExtension

    programs = list(programs)
    built: dict[int, ProgramRoutes] = {}

    def routes_for(engine) -> ProgramRoutes:
        if id(engine) not in built:
            built[id(engine)] = ProgramRoutes(programs, LocalBackend(engine))
        return built[id(engine)]

    return AppExtension(
        routers=lambda engine: [routes_for(engine).router()],
        line_routes=lambda engine: dict(routes_for(engine).routes),
    )


def load_programs(specs: Iterable[str]) -> list[Program]:
    """`module:attr` names one program; `module` alone, every program it defines."""
    found: dict[str, Program] = {}
    for spec in specs:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise UsageError(f"--program {spec!r}: cannot import {module_name!r}: {err}") from err
        values = [getattr(module, attr, None)] if attr else list(vars(module).values())
        programs = [v for v in values if isinstance(v, Program)]
        if not programs:
            raise UsageError(f"--program {spec!r}: names no flowlang program")
        for p in programs:
            if found.get(p.name, p) is not p:
                raise UsageError(f"--program {spec!r}: a second program named {p.name!r}")
            found[p.name] = p
    return list(found.values())
