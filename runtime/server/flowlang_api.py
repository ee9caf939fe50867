"""flowlang's remote protocol (RemoteBackend): model info, tokenize, generate with graph hints,
score, and pins held as leases."""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from runtime.engine_api import EngineAPI
from runtime.protocol import GenerateRequest, GraphHints, PinInfo, ScoreRequest, ScoreResult
from runtime.scoring import Cancellation, check_score_size, num_in_flight
from runtime.server.agent_hints import tenant_hints
from runtime.server.state import ServerDep, TenantHandle
from runtime.server.streaming import sse, unless_gone

router = APIRouter(prefix="/v1/flowlang")


class PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix_ids: list[int] = Field(min_length=1)
    namespace: str | None = None
    hints: GraphHints = Field(default_factory=GraphHints)
    lease_seconds: float | None = Field(None, gt=0, le=3600)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str
    add_special_tokens: bool = False


@router.get("/info")
async def info(server: ServerDep):
    """What a client needs to format prompts and size its cache: template, special tokens."""
    engine = server.engine
    tokenizer = engine.tokenizer
    return {
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "model": engine.config.model,
        "num_layers": engine.arch.num_layers,
        "num_kv_heads": engine.arch.num_kv_heads,
        "head_dim": engine.arch.head_dim,
        "dtype": engine.config.dtype,
        "tool_format": engine.tool_format,
        "reasoning_format": engine.reasoning_format,
    }


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, server: ServerDep):
    """Token ids of `text`."""
    tokens = server.engine.tokens  # validated, and off the event loop (large texts)
    return {"ids": await asyncio.to_thread(tokens, body.text, body.add_special_tokens)}


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, server: ServerDep):
    """One request, streamed: {"delta": text} events, then {"result": GenerateResult}."""
    namespace = server.namespace(request, body.namespace)
    hints = tenant_hints(server, request, body.hints)
    body = body.model_copy(update={"namespace": namespace, "hints": hints})
    handles = await server.submit([body], server.tenant(request))
    return sse(server.engine, handles, _events(handles[0]))


async def _events(handle: TenantHandle) -> AsyncGenerator[str, None]:
    async for delta in handle.astream():
        yield json.dumps({"delta": delta})
    result = await handle.aresult()
    yield json.dumps({"result": result.model_dump()})


# Scores run on threads of their own: a long one would otherwise hold one of the threads that
# submit every other request.
_SCORE_THREADS = ThreadPoolExecutor(max_workers=8, thread_name_prefix="score")


@router.post("/score")
async def score(body: ScoreRequest, request: Request, server: ServerDep):
    """Per-token logprobs of each continuation after the prefix; the continuations it has in
    the engine at once count against the caller's requests in flight (at most all of them)."""
    check_score_size(body)
    body = body.model_copy(update={"namespace": server.namespace(request, body.namespace)})
    tenant = server.tenant(request)
    num_requests = min(num_in_flight(body), server.settings.max_requests_per_key)
    server.reserve_work(tenant, num_requests)
    cancel = Cancellation()  # a client that goes away stops its score, as it does a generate
    run = asyncio.get_running_loop().run_in_executor
    in_context = contextvars.copy_context().run  # the caller's trace (traceparent) goes along
    work = asyncio.ensure_future(
        run(_SCORE_THREADS, in_context, _score_one, server.engine, body, cancel)
    )
    work.add_done_callback(lambda _: server.release_work(tenant, num_requests))
    return (await unless_gone(request, work, cancel.cancel)).model_dump()


def _score_one(engine: EngineAPI, body: ScoreRequest, cancel: Cancellation) -> ScoreResult:
    (result,) = engine.score(body, cancel)
    return result


@router.post("/pin")
async def pin(body: PinBody, request: Request, server: ServerDep):
    """Pin a prefix in the cache under a lease the client must renew."""
    namespace, tenant = server.namespace(request, body.namespace), server.tenant(request)
    # an engine without a prefix cache holds nothing for a pin (Engine.pin): no quota taken
    num_tokens = len(body.prefix_ids) if server.engine.caches_prefixes else 0
    server.leases.reserve(tenant, num_tokens)  # before the prefill: concurrent pins count
    try:
        hints = tenant_hints(server, request, body.hints)
        handle = await asyncio.to_thread(server.engine.pin, body.prefix_ids, namespace, hints)
    except BaseException:
        server.leases.unreserve(tenant, num_tokens)
        raise
    lease = server.leases.add(handle, tenant, body.lease_seconds, reserved_tokens=num_tokens)
    info: PinInfo = handle.info
    return {**info.model_dump(), "lease_seconds": lease.lease_seconds}


@router.post("/pin/{pin_id}/renew")
async def renew(pin_id: str, request: Request, server: ServerDep):
    """Restart a held pin's lease; 404 when the caller holds no such pin."""
    lease = server.leases.renew(pin_id, server.tenant(request))
    return {"pin_id": pin_id, "lease_seconds": lease.lease_seconds}


@router.delete("/pin/{pin_id}")
async def unpin(pin_id: str, request: Request, server: ServerDep):
    """Release a held pin; 404 when the caller holds no such pin."""
    server.leases.release(pin_id, server.tenant(request))
    return {"pin_id": pin_id, "released": True}
