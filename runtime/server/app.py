"""The HTTP server: SGLang's native API, the OpenAI API, and what flowlang needs (tokenize,
generate with graph hints, score, pins with leases), over one Engine.

    flowlang serve --model smollm2-135m-instruct --port 30000
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from runtime.engine import Engine, EngineClosedError, InvalidRequestError, RequestHandle
from runtime.protocol import (
    GenerateRequest,
    GenerateResult,
    GraphHints,
    PinInfo,
    ScoreRequest,
)
from runtime.server import openai_api
from runtime.server.common import (
    ClientGone,
    Server,
    ServerSettings,
    error_response,
    sse,
)
from runtime.server.metrics import prometheus_text
from runtime.server.schemas import GenerateBody


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


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    server = Server(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def expire_leases() -> None:
            while True:
                await asyncio.sleep(min(1.0, settings.pin_lease_seconds / 4))
                server.leases.expire()

        task = asyncio.create_task(expire_leases())
        yield
        task.cancel()
        server.leases.release_all()
        await asyncio.to_thread(engine.close, settings.drain_timeout)

    app = FastAPI(title="flowlang", lifespan=lifespan)
    app.state.server = server

    @app.middleware("http")
    async def guard(request: Request, call_next):
        server.http_requests[request.url.path] += 1
        length = request.headers.get("content-length")
        if length is not None and int(length) > settings.max_body_bytes:
            return error_response(
                413,
                f"request body of {length} bytes exceeds the limit of {settings.max_body_bytes}",
                server,
            )
        request.state.tenant = "anonymous"
        if server.keys and request.url.path != "/health":
            header = request.headers.get("authorization", "")
            key = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if key not in server.keys:
                return error_response(
                    401, "missing or invalid API key (Authorization: Bearer ...)", server
                )
            request.state.tenant = server.keys[key]
        return await call_next(request)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, err: InvalidRequestError):
        return error_response(400, str(err), server)

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, err: ValueError):
        return error_response(400, str(err), server)

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, err: RequestValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return error_response(422, f"invalid request: {problems}", server)

    @app.exception_handler(EngineClosedError)
    async def closed(request: Request, err: EngineClosedError):
        return error_response(503, "the server is shutting down", server)

    @app.exception_handler(KeyError)
    async def not_found(request: Request, err: KeyError):
        return error_response(404, str(err.args[0]) if err.args else "not found", server)

    @app.exception_handler(ClientGone)
    async def gone(request: Request, err: ClientGone):
        return error_response(499, "client closed the request", server)

    # ------------------------------------------------------------------ operations
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info():
        arch = engine.arch
        return {
            "model_path": engine.config.model,
            "tokenizer_path": engine.config.model,
            "is_generation": True,
            "max_context_len": arch.max_context_len,
            "vocab_size": arch.vocab_size,
            "num_layers": arch.num_layers,
        }

    @app.get("/server_info")
    async def server_info():
        stats = await asyncio.to_thread(engine.stats)
        return {
            "config": engine.config.model_dump(),
            "stats": stats,
            "version": "flowlang-0.1.0",
            "uptime_s": time.time() - server.started,
            "pins": len(server.leases),
        }

    @app.post("/flush_cache")
    async def flush_cache():
        return {"flushed_tokens": await asyncio.to_thread(engine.flush_cache)}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        stats = await asyncio.to_thread(engine.stats)
        return prometheus_text(
            stats,
            server.http_requests,
            server.http_errors,
            len(server.leases),
            server.leases.num_expired,
        )

    # ------------------------------------------------------------------ SGLang native
    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        prompts = _native_prompts(body)
        params, constraint = body.sampling_params.to_protocol(
            logprobs=body.return_logprob,
            top_logprobs=body.top_logprobs_num,
            prompt_logprobs=body.return_logprob and body.logprob_start_len >= 0,
            logprob_start_len=max(1, body.logprob_start_len)
            if body.logprob_start_len >= 0
            else None,
        )
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        requests = [
            GenerateRequest(
                rid=rid or uuid.uuid4().hex,
                sampling=params,
                constraint=constraint,
                namespace=server.namespace(request, body.namespace),
                **({"text": p} if isinstance(p, str) else {"input_ids": p}),
            )
            for p, rid in zip(prompts, rids, strict=True)
        ]
        handles = [server.submit(r) for r in requests]
        if body.stream:
            if len(handles) != 1:
                raise ValueError("stream=true takes a single prompt")
            return sse(_native_stream(server, handles[0], body))
        results = await server.wait(request, handles)
        out = [_native_result(engine, r, body) for r in results]
        return out if body.is_batch else out[0]

    # ------------------------------------------------------------------ OpenAI
    openai_api.register(app, server)

    # ------------------------------------------------------------------ flowlang
    @app.get("/v1/flowlang/info")
    async def flowlang_info():
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
        }

    @app.post("/v1/flowlang/tokenize")
    async def tokenize(body: TokenizeBody):
        return {
            "ids": engine.tokenizer.encode(body.text, add_special_tokens=body.add_special_tokens)
        }

    @app.post("/v1/flowlang/generate")
    async def flowlang_generate(body: GenerateRequest, request: Request):
        body = body.model_copy(update={"namespace": server.namespace(request, body.namespace)})
        handle = server.submit(body)

        async def events() -> AsyncIterator[str]:
            try:
                async for delta in handle.astream():
                    yield json.dumps({"delta": delta})
                result = await handle.aresult()
                yield json.dumps({"result": result.model_dump()})
            finally:
                if not handle.future.done():
                    engine.abort(handle.rid)

        return sse(events())

    @app.post("/v1/flowlang/score")
    async def flowlang_score(body: ScoreRequest, request: Request):
        body = body.model_copy(update={"namespace": server.namespace(request, body.namespace)})
        (result,) = await asyncio.to_thread(engine.score, body)
        return result.model_dump()

    @app.post("/v1/flowlang/pin")
    async def flowlang_pin(body: PinBody, request: Request):
        namespace = server.namespace(request, body.namespace)
        handle = await asyncio.to_thread(engine.pin, body.prefix_ids, namespace, body.hints)
        lease = server.leases.add(handle, server.tenant(request), body.lease_seconds)
        info: PinInfo = handle.info
        return {**info.model_dump(), "lease_seconds": lease.lease_seconds}

    @app.post("/v1/flowlang/pin/{pin_id}/renew")
    async def flowlang_renew(pin_id: str, request: Request):
        lease = server.leases.renew(pin_id, server.tenant(request))
        return {"pin_id": pin_id, "lease_seconds": lease.lease_seconds}

    @app.delete("/v1/flowlang/pin/{pin_id}")
    async def flowlang_unpin(pin_id: str, request: Request):
        server.leases.release(pin_id, server.tenant(request))
        return {"pin_id": pin_id, "released": True}

    return app


def _native_prompts(body: GenerateBody) -> list[str | list[int]]:
    if body.text is not None:
        return body.text if isinstance(body.text, list) else [body.text]
    return body.input_ids if body.is_batch else [body.input_ids]


def _finish_reason(result: GenerateResult) -> dict | None:
    if result.finish_reason is None:
        return None
    reason = {"type": result.finish_reason}
    if result.matched_stop is not None:
        reason["matched"] = result.matched_stop
    if result.finish_reason == "length":
        reason["length"] = result.completion_tokens
    return reason


def _native_result(engine: Engine, result: GenerateResult, body: GenerateBody) -> dict:
    if result.finish_reason == "error":
        raise InvalidRequestError(result.error or "generation failed")
    meta = {
        "id": result.rid,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "finish_reason": _finish_reason(result),
    }
    if body.return_logprob:

        def text(token_id: int):
            return engine.tokenizer.decode([token_id]) if body.return_text_in_logprobs else None

        logprobs = result.logprobs or []
        meta["output_token_logprobs"] = [
            [lp.logprob, lp.token_id, text(lp.token_id)] for lp in logprobs
        ]
        meta["output_top_logprobs"] = [
            [[v, t, text(t)] for t, v in (lp.top or [])] for lp in logprobs
        ]
        if result.prompt_logprobs is not None:
            start = max(1, body.logprob_start_len)
            ids = result.prompt_ids
            meta["input_token_logprobs"] = [
                [result.prompt_logprobs[j], ids[j], text(ids[j])] for j in range(start, len(ids))
            ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


async def _native_stream(
    server: Server, handle: RequestHandle, body: GenerateBody
) -> AsyncIterator[str]:
    text = ""
    try:
        async for delta in handle.astream():
            text += delta
            yield json.dumps({"text": text, "meta_info": {"id": handle.rid}})
        result = await handle.aresult()
        yield json.dumps(_native_result(server.engine, result, body))
    finally:
        if not handle.future.done():
            server.engine.abort(handle.rid)


def serve(engine_config, settings: ServerSettings) -> None:
    """Run the server until interrupted; then drain, release every pin, stop the engine."""
    import uvicorn

    engine = Engine(engine_config)
    app = create_app(engine, settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=int(settings.drain_timeout) + 5,
    )
