"""SGLang's native routes besides /generate: model and server info, the cache flush, the
generating health check, /encode, the profile window, the frontend's concate-and-append, and
the tool-call and reasoning parsers (/parse_function_call, /separate_reasoning).

Where flowlang's answer differs from SGLang's, the route's docstring says how and why.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Body, Request, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from runtime.engine_api import EngineAPI
from runtime.errors import InvalidRequestError
from runtime.model.registry import MODELS
from runtime.protocol import GenerateRequest, SamplingParams, ToolSpec
from runtime.server.sglang_schemas import SGLangFields, ignored_field
from runtime.server.state import ServerDep
from runtime.server.tenant_pool import TEXT_WORK

router = APIRouter()

HEALTH_TIMEOUT_S = 20.0  # SGLang's default health-check wait
MAX_PARSE_TEXT_CHARS = 1 << 19  # /parse_function_call: a 128k-token output, ~4 characters each
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@router.get("/get_model_info")
@router.get("/model_info")
async def model_info(server: ServerDep):
    """The model as SGLang reports it: `model_path` is the Hugging Face repo id when flowlang
    knows it (SGLang's frontend picks its chat template from that path), else the path given."""
    engine = server.engine
    path = model_path(engine)
    hf_config = engine.arch.hf_config
    return {
        "model_path": path,
        "served_model_name": engine.config.model,
        "tokenizer_path": path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": engine.arch.model_type,
        "architectures": getattr(hf_config, "architectures", None)
        or [ARCHITECTURES.get(engine.arch.model_type, "LlamaForCausalLM")],
        "max_context_len": engine.arch.max_context_len,
        "vocab_size": engine.arch.vocab_size,
        "num_layers": engine.arch.num_layers,
    }


def model_path(engine: EngineAPI) -> str:
    """The Hugging Face repo id of a registry model, else the name or path it was loaded by."""
    entry = MODELS.get(engine.config.model)
    return entry.hf_repo_id if entry is not None and entry.hf_repo_id else engine.config.model


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(server: ServerDep):
    """The engine's config and stats, uptime and held pins."""
    stats = await asyncio.to_thread(server.engine.stats)
    return {
        "model_path": model_path(server.engine),
        "config": server.engine.config.model_dump(),
        "stats": stats,
        "version": "flowlang-0.1.0",
        "uptime_s": time.time() - server.started,
        "pins": len(server.leases),
    }


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(server: ServerDep):
    """Evict every unlocked cached token (what running requests hold stays)."""
    return {"flushed_tokens": await asyncio.to_thread(server.engine.flush_cache)}


@router.get("/health_generate")
async def health_generate(request: Request, server: ServerDep) -> Response:
    """200 once the engine has generated one token for a probe request; 503 if it cannot
    within HEALTH_TIMEOUT_S (SGLang's probe, which skips the work when the server is busy)."""
    probe = GenerateRequest(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_ids=[0],
        sampling=SamplingParams(max_new_tokens=1, temperature=0),
    )
    (handle,) = await server.submit([probe], server.tenant(request))
    try:
        (result,) = await asyncio.wait_for(server.wait(request, [handle]), HEALTH_TIMEOUT_S)
    except TimeoutError:
        handle.cancel()
        return Response(status_code=503)
    return Response(status_code=503 if result.finish_reason in ("error", "abort") else 200)


class AbortBody(SGLangFields):
    rid: str = ""
    abort_all: bool = False


@router.post("/abort_request")
async def abort_request(body: AbortBody, request: Request, server: ServerDep):
    """Abort the caller's request `rid` (its result says finish_reason "abort"), or with
    `abort_all` every request the caller has in flight. Differs from SGLang, which answers 200
    whatever the id: an id the caller has not in flight is a 404 (request ids are per API key,
    so another key's request is never reached, nor is its id confirmed)."""
    tenant = server.tenant(request)
    if body.abort_all:
        return {"rids": server.abort_all(tenant)}
    server.abort(tenant, body.rid)
    return {"rid": body.rid}


@router.api_route("/encode", methods=["POST", "PUT"])
async def encode(body: dict[str, Any] = Body(...)):  # noqa: B008 - FastAPI's idiom
    """Embeddings need an embedding model; flowlang serves generation models, so this is the
    400 SGLang gives for /encode on a generation model."""
    raise InvalidRequestError(
        "this server runs a generation model and /encode needs an embedding model "
        "(SGLang answers the same for generation models); use /generate"
    )


class ProfileBody(SGLangFields):
    """SGLang's profile request: options of its torch trace, which flowlang does not write."""

    output_dir: str | None = ignored_field("no trace file is written")
    start_step: int | None = ignored_field("the window starts at the call")
    num_steps: int | None = ignored_field("the window ends at /stop_profile")
    activities: list[str] | None = ignored_field("counters, not a torch trace")
    profile_by_stage: bool = ignored_field("counters, not a torch trace", False)
    with_stack: bool | None = ignored_field("counters, not a torch trace")
    record_shapes: bool | None = ignored_field("counters, not a torch trace")
    profile_id: str | None = ignored_field("one window at a time")
    merge_profiles: bool = ignored_field("one engine", False)
    profile_prefix: str | None = ignored_field("no trace file is written")
    profile_stages: list[str] | None = ignored_field("counters, not a torch trace")
    detailed_annotations: bool = ignored_field("counters, not a torch trace", False)


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(
    request: Request,
    server: ServerDep,
    body: ProfileBody | None = Body(None),  # noqa: B008 - FastAPI's idiom
):
    """Open a profile window. Differs from SGLang: the profile is the engine's counters over
    the window (steps, tokens, cache hits), returned by /stop_profile, not a torch trace (the
    torch profiler records only the thread that starts it, and the engine runs on its own)."""
    stats = await asyncio.to_thread(server.engine.stats)
    request.app.state.sglang_profile = (time.monotonic(), stats)
    return {
        "message": "Start profiling.",
        "ignored": (body or ProfileBody()).fields_of_kind("ignored"),
    }


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(request: Request, server: ServerDep):
    """Close the profile window: how much each engine counter grew, and the gauges now."""
    window = getattr(request.app.state, "sglang_profile", None)
    if window is None:
        raise InvalidRequestError("no profile is running: call /start_profile first")
    request.app.state.sglang_profile = None
    started, before = window
    after = await asyncio.to_thread(server.engine.stats)
    counters = {k: v - before[k] for k, v in after.items() if k.endswith("_total")}
    gauges = {k: v for k, v in after.items() if not k.endswith("_total")}
    return {
        "message": "Stop profiling.",
        "duration_s": time.monotonic() - started,
        "counters": counters,
        "gauges": gauges,
    }


class ConcatenateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    src_rids: list[str]
    dst_rid: str


@router.post("/concate_and_append_request")
async def concate_and_append_request(body: ConcatenateBody):
    """Join of forked branches in SGLang's frontend ("parallel encoding"). Differs from SGLang,
    whose old route copied the branches' KV (each computed without seeing the others) after
    the parent's: flowlang keeps attention exact, so nothing is copied. The frontend's next
    request carries the joined text, and the radix cache reuses the shared prefix and the first
    branch (each branch's text was prefilled by the frontend before this call)."""
    return {"success": True, "src_rids": body.src_rids, "dst_rid": body.dst_rid}


class _SGLangTool(SGLangFields):
    type: str = "function"
    function: dict[str, Any]
    defer_loading: bool | None = ignored_field("every tool is offered at once")


class ParseFunctionCallBody(SGLangFields):
    text: str
    tools: list[_SGLangTool] = []
    tool_call_parser: str | None = None


class SeparateReasoningBody(SGLangFields):
    text: str
    reasoning_parser: str
    return_blocks: bool = False


@router.post("/parse_function_call")
async def parse_function_call(body: ParseFunctionCallBody, request: Request, server: ServerDep):
    """Tool calls read out of a text, as SGLang's route answers (`normal_text`, `calls` with
    `tool_index`, `name` and `parameters` as a JSON string); the parser defaults to the
    model's tool format (SGLang tries every parser instead). The text is at most
    MAX_PARSE_TEXT_CHARS, parsed on the threads for request texts (never the event loop)."""
    from runtime.constrain.tool_calls import UnknownToolFormat, tool_format

    if len(body.text) > MAX_PARSE_TEXT_CHARS:
        raise InvalidRequestError(
            f"text: {len(body.text)} characters; /parse_function_call takes at most "
            f"{MAX_PARSE_TEXT_CHARS} (MAX_PARSE_TEXT_CHARS)"
        )
    try:
        fmt = tool_format(body.tool_call_parser or server.engine.tool_format)
        tools = [
            ToolSpec(
                name=t.function.get("name", ""),
                description=t.function.get("description") or "",
                parameters=t.function.get("parameters") or {"type": "object", "properties": {}},
            )
            for t in body.tools
        ]
    except (UnknownToolFormat, ValidationError) as err:
        raise InvalidRequestError(str(err)) from err
    limit = server.settings.max_requests_per_key
    parsed = await TEXT_WORK.run(server.tenant(request), limit, fmt.parse, body.text, tools)
    index = {t.name: i for i, t in enumerate(tools)}
    calls = [
        {"tool_index": index[c.name], "name": c.name, "parameters": c.arguments}
        for c in parsed.calls
    ]
    return {"normal_text": parsed.content, "calls": calls}


@router.post("/separate_reasoning")
async def separate_reasoning(body: SeparateReasoningBody):
    """The reasoning and the answer of a text, as SGLang's route answers. As SGLang's
    parsers, deepseek-r1 reads the text as starting inside the reasoning block."""
    from runtime.constrain.reasoning import UnknownReasoningFormat, reasoning_format

    try:
        fmt = reasoning_format(body.reasoning_parser)
    except UnknownReasoningFormat as err:
        raise InvalidRequestError(str(err)) from err
    reasoning, text = fmt.split(body.text, in_reasoning=fmt.name == "deepseek-r1")
    out: dict[str, Any] = {"reasoning_text": reasoning or "", "text": text}
    if body.return_blocks:
        blocks = [{"type": "reasoning", "text": reasoning}] if reasoning else []
        blocks.append({"type": "text", "text": text})
        out["reasoning_blocks"] = [reasoning] if reasoning else []
        out["text_blocks"] = [text]
        out["blocks"] = blocks
    return out
