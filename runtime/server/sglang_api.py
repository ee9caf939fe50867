"""SGLang's native API: /generate (text or ids, single or batch, streamed, with logprobs),
model and server info, and the cache flush."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request

from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.handles import RequestHandle
from runtime.protocol import GenerateRequest, GenerateResult
from runtime.server.errors import invalid_input
from runtime.server.schemas import GenerateBody
from runtime.server.state import ServerDep
from runtime.server.streaming import sse

router = APIRouter()


@router.get("/get_model_info")
async def model_info(server: ServerDep):
    """The model's path and shape, as SGLang reports them."""
    engine = server.engine
    return {
        "model_path": engine.config.model,
        "tokenizer_path": engine.config.model,
        "is_generation": True,
        "max_context_len": engine.arch.max_context_len,
        "vocab_size": engine.arch.vocab_size,
        "num_layers": engine.arch.num_layers,
    }


@router.get("/server_info")
async def server_info(server: ServerDep):
    """The engine's config and stats, uptime and held pins."""
    stats = await asyncio.to_thread(server.engine.stats)
    return {
        "config": server.engine.config.model_dump(),
        "stats": stats,
        "version": "flowlang-0.1.0",
        "uptime_s": time.time() - server.started,
        "pins": len(server.leases),
    }


@router.post("/flush_cache")
async def flush_cache(server: ServerDep):
    """Evict every unlocked cached token."""
    return {"flushed_tokens": await asyncio.to_thread(server.engine.flush_cache)}


@router.post("/generate")
async def generate(body: GenerateBody, request: Request, server: ServerDep):
    """Generate for one prompt or a batch; `stream` sends the text so far as it grows."""
    requests = _requests(body, server.namespace(request, body.namespace))
    if body.stream and len(requests) != 1:
        raise InvalidRequestError("stream=true takes a single prompt")
    handles = server.submit(requests)
    if body.stream:
        return sse(server.engine, handles, _stream(server.engine, handles[0], body))
    results = await server.wait(request, handles)
    out = [_result(server.engine, r, body) for r in results]
    return out if body.is_batch else out[0]


def _requests(body: GenerateBody, namespace: str | None) -> list[GenerateRequest]:
    if body.text is not None:
        prompts = body.text if isinstance(body.text, list) else [body.text]
    else:
        prompts = body.input_ids if body.is_batch else [body.input_ids]
    params, constraint = body.sampling_params.to_protocol(
        logprobs=body.return_logprob,
        top_logprobs=body.top_logprobs_num,
        prompt_logprobs=body.return_logprob and body.logprob_start_len >= 0,
        logprob_start_len=max(1, body.logprob_start_len) if body.logprob_start_len >= 0 else None,
    )
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    if len(rids) != len(prompts):
        raise InvalidRequestError(f"rid has {len(rids)} ids for {len(prompts)} prompts")
    with invalid_input():
        return [
            GenerateRequest(
                rid=rid or uuid.uuid4().hex,
                sampling=params,
                constraint=constraint,
                namespace=namespace,
                **({"text": p} if isinstance(p, str) else {"input_ids": p}),
            )
            for p, rid in zip(prompts, rids, strict=True)
        ]


async def _stream(
    engine: Engine, handle: RequestHandle, body: GenerateBody
) -> AsyncGenerator[str, None]:
    text = ""
    async for delta in handle.astream():
        text += delta
        yield json.dumps({"text": text, "meta_info": {"id": handle.rid}})
    yield json.dumps(_result(engine, await handle.aresult(), body))


def _finish_reason(result: GenerateResult) -> dict | None:
    if result.finish_reason is None:
        return None
    reason = {"type": result.finish_reason}
    if result.matched_stop is not None:
        reason["matched"] = result.matched_stop
    if result.finish_reason == "length":
        reason["length"] = result.completion_tokens
    return reason


def _result(engine: Engine, result: GenerateResult, body: GenerateBody) -> dict:
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
        meta.update(_logprobs(engine, result, body))
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


def _logprobs(engine: Engine, result: GenerateResult, body: GenerateBody) -> dict:
    def text(token_id: int) -> str | None:
        return engine.tokenizer.decode([token_id]) if body.return_text_in_logprobs else None

    logprobs = result.logprobs or []
    out = {
        "output_token_logprobs": [[lp.logprob, lp.token_id, text(lp.token_id)] for lp in logprobs],
        "output_top_logprobs": [[[v, t, text(t)] for t, v in (lp.top or [])] for lp in logprobs],
    }
    if result.prompt_logprobs is not None:
        start, ids = max(1, body.logprob_start_len), result.prompt_ids
        out["input_token_logprobs"] = [
            [result.prompt_logprobs[j], ids[j], text(ids[j])] for j in range(start, len(ids))
        ]
    return out
