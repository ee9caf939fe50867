"""What a layer above the runtime adds to the server without the runtime importing it:
routes (flowlang's registered programs) and batch line routes for them. `flowlang serve`
builds the extensions and hands them to `serve`; each is made once the engine exists."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter

from runtime.engine_api import EngineAPI


def _no_routers(engine: EngineAPI) -> Sequence[APIRouter]:
    return ()


def _no_line_routes(engine: EngineAPI) -> Mapping[str, Any]:
    return {}


@dataclass(frozen=True)
class AppExtension:
    """`routers(engine)`: added to the app; `line_routes(engine)`: url -> LineRoute
    (runtime/batches/runner.py) that batch files may name besides the OpenAI routes."""

    routers: Callable[[EngineAPI], Sequence[APIRouter]] = _no_routers
    line_routes: Callable[[EngineAPI], Mapping[str, Any]] = field(default=_no_line_routes)


def install_extensions(app: Any, engine: EngineAPI, extensions: Sequence[AppExtension]) -> None:
    """Include every extension's routers; gather their line routes in app.state.line_routes."""
    line_routes: dict[str, Any] = {}
    for extension in extensions:
        for router in extension.routers(engine):
            app.include_router(router)
        line_routes.update(extension.line_routes(engine))
    app.state.line_routes = line_routes
