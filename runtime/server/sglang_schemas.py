"""SGLang's native /generate body, field for field as SGLang 0.5.23 takes it (its
`GenerateReqInput` and `SamplingParams`), expanded into one `Prompt` per request to run.

Every field SGLang accepts is accepted here, as one of three kinds, so nothing is dropped
without saying so:
- honoured: typed and mapped onto the engine;
- ignored: a server-side knob with no meaning for one text-only engine (routing, metrics,
  tracing); it has no effect, and a request that sets one says so in the server's log;
- unsupported: a feature flowlang does not have (images, LoRA, hidden states, ...); accepted
  unset (null, false, empty), otherwise a 400 that names it.
A field SGLang does not know is a 422, as SGLang's own server answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from runtime.errors import InvalidRequestError
from runtime.protocol import Constraint, GraphHints, SamplingParams
from runtime.server.errors import invalid_input
from runtime.server.fields import AuditedFields, ignored_field, unsupported_field

MAX_PARALLEL_SAMPLES = 256  # n: each sample is one engine request


_MEDIA = "flowlang serves text-only models"
_ROUTING = "routing metadata for a multi-worker deployment; one engine serves every request"


class SGLangFields(AuditedFields):
    """An SGLang body: honoured, ignored and unsupported fields; unknown ones are a 422."""

    api_name = "SGLang"


class SGLangSamplingParams(SGLangFields):
    """SGLang's sampling_params; null means the default, as in SGLang."""

    max_new_tokens: int | None = Field(128, ge=0, description="null: as many as fit")
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 (or 0): no top-k restriction")
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = Field(
        True,
        description="the same as in SGLang, which passes it to the tokenizer's decode: the "
        "fast tokenizers flowlang serves ignore it, so either value gives the same text",
    )
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None  # a JSON string, as SGLang takes it
    ebnf: str | None = None
    n: int = Field(1, ge=1, le=MAX_PARALLEL_SAMPLES)
    stream_interval: int | None = ignored_field("every token is streamed as soon as it is final")
    beam_width: int | None = unsupported_field("beam search")
    structural_tag: str | None = Field(
        None,
        description="a JSON string: xgrammar's structural tag (SGLang's legacy "
        "{structures, triggers} form too)",
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> a bias in -100..100 added to its logit"
    )
    custom_params: dict[str, Any] | None = unsupported_field("custom logit processors")
    watermark: Any = unsupported_field("watermarking")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # SGLang treats null as "the default" for every field but max_new_tokens, and an empty
        # grammar as no grammar
        if not isinstance(data, dict):
            return data
        grammars = ("regex", "json_schema", "ebnf", "structural_tag")
        return {
            k: v
            for k, v in data.items()
            if k == "max_new_tokens" or not (v is None or (k in grammars and v == ""))
        }

    def to_protocol(
        self, *, max_new_tokens: int, seed_offset: int, **logprobs: Any
    ) -> tuple[SamplingParams, Constraint | None]:
        """The engine's sampling parameters and constraint; values it rejects are a 400."""
        seed = None if self.sampling_seed is None else self.sampling_seed + seed_offset
        with invalid_input():
            params = SamplingParams(
                max_new_tokens=max_new_tokens,
                min_new_tokens=self.min_new_tokens,
                stop_regex=self.stop_regex,
                include_stop_str_in_output=self.no_stop_trim,
                seed=seed,
                **common_sampling_fields(self),
                **logprobs,
            )
        return params, constraint_of(
            regex=self.regex,
            json_schema=self.json_schema,
            grammar=self.ebnf,
            structural_tag=self.structural_tag,
        )


@dataclass(frozen=True)
class Prompt:
    """One engine request of a /generate call: a prompt (one of n samples) and its options."""

    rid: str | None
    prompt: str | list[int]
    sampling: SGLangSamplingParams
    return_logprob: bool
    logprob_start_len: int  # -1: the prompt's only when nothing is generated
    top_logprobs_num: int
    cache_salt: str | None  # namespace, cache_salt and extra_key joined
    prompt_index: int  # in the call's list of prompts
    sample_index: int  # 0..n-1


class GenerateBody(SGLangFields):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | None = Field(None, description="higher runs first (schedule_policy=priority)")
    cache_salt: str | list[str] | None = Field(None, description="cache namespace")
    extra_key: str | list[str] | None = Field(None, description="cache namespace, with cache_salt")
    namespace: str | None = Field(None, description="flowlang's name for cache_salt")
    session_id: str | None = Field(
        None, description="the requests that share it are one program (agent_hints.py)"
    )
    hints: GraphHints | None = Field(
        None, description="flowlang's graph hints, as /v1/flowlang/generate takes them"
    )
    # SGLang knobs with no meaning here
    log_metrics: bool = ignored_field("every request is counted in /metrics", True)
    routed_dp_rank: int | None = ignored_field(_ROUTING)
    data_parallel_rank: int | None = ignored_field(_ROUTING)
    disagg_prefill_dp_rank: int | None = ignored_field(_ROUTING)
    routing_key: str | None = ignored_field(_ROUTING)
    conversation_id: str | None = ignored_field("request tracking metadata")
    http_worker_ipc: str | None = ignored_field("SGLang's multi-tokenizer internals")
    background: bool = ignored_field("OpenAI responses-API internals", False)
    no_logs: bool = ignored_field("flowlang never logs request contents", False)
    custom_labels: dict[str, str] | None = ignored_field("metric labels")
    external_trace_header: dict[str, Any] | None = ignored_field("tracing")
    received_time: float | None = ignored_field("tracing")
    kv_hints: Any = ignored_field("hints for SGLang's HiCache storage backends")
    # SGLang features flowlang does not have
    input_embeds: Any = unsupported_field("prompts as embeddings")
    image_data: Any = unsupported_field(_MEDIA)
    video_data: Any = unsupported_field(_MEDIA)
    audio_data: Any = unsupported_field(_MEDIA)
    mm_hashes: Any = unsupported_field(_MEDIA)
    mm_content_hashes: Any = unsupported_field(_MEDIA)
    use_audio_in_video: bool = unsupported_field(_MEDIA, False)
    video_config: Any = unsupported_field(_MEDIA)
    modalities: Any = unsupported_field(_MEDIA)
    max_dynamic_patch: Any = unsupported_field(_MEDIA)
    min_dynamic_patch: Any = unsupported_field(_MEDIA)
    image_max_dynamic_patch: Any = unsupported_field(_MEDIA)
    video_max_dynamic_patch: Any = unsupported_field(_MEDIA)
    images_config: Any = unsupported_field(_MEDIA)
    mm_processor_kwargs: Any = unsupported_field(_MEDIA)
    need_wait_for_mm_inputs: Any = unsupported_field(_MEDIA)
    num_items_assigned: Any = unsupported_field(_MEDIA)
    encoder_urls: Any = unsupported_field(_MEDIA)
    watermark: Any = unsupported_field("watermarking")
    token_ids_logprob: Any = unsupported_field("logprobs of chosen token ids")
    return_sampling_mask: Any = unsupported_field("sampling masks")
    sampling_logprobs_mode: Any = unsupported_field("sampling masks")
    return_flat_raw_top_logprobs: bool = unsupported_field("flat logprob arrays", False)
    return_flat_raw_output_top_logprobs: bool = unsupported_field("flat logprob arrays", False)
    return_flat_raw_top_logprobs_b64: bool = unsupported_field("flat logprob arrays", False)
    return_hidden_states: Any = unsupported_field("hidden states", False)
    return_routed_experts: bool = unsupported_field("MoE routing (no MoE models)", False)
    routed_experts_start_len: int = unsupported_field("MoE routing (no MoE models)", 0)
    return_indexer_topk: bool = unsupported_field("sparse-attention indexers", False)
    return_entropy: bool = unsupported_field("entropy", False)
    return_bytes: bool = unsupported_field("image generation", False)
    session_params: Any = unsupported_field("sessions that rebuild the prompt")
    lora_path: Any = unsupported_field("LoRA adapters")
    lora_id: Any = unsupported_field("LoRA adapters")
    custom_logit_processor: Any = unsupported_field("custom logit processors")
    positional_embed_overrides: Any = unsupported_field("embedding overrides")
    bootstrap_host: Any = unsupported_field("prefill/decode disaggregation")
    bootstrap_port: Any = unsupported_field("prefill/decode disaggregation")
    bootstrap_room: Any = unsupported_field("prefill/decode disaggregation")
    bootstrap_pair_key: Any = unsupported_field("prefill/decode disaggregation")
    decode_tp_size: Any = unsupported_field("prefill/decode disaggregation")
    require_reasoning: bool = unsupported_field("reasoning budgets", False)
    max_thinking_tokens: int | None = unsupported_field("reasoning budgets")
    multi_item_delimiter_indices: Any = unsupported_field("multi-item scoring")
    token_indices_to_pool: Any = unsupported_field("pooling readouts")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateBody:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self

    @property
    def is_batch(self) -> bool:
        """A list of prompts, or one prompt with n > 1 (SGLang answers a list for both)."""
        if self.samples_per_prompt > 1:
            return True
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    @property
    def samples_per_prompt(self) -> int:
        """n: SGLang requires the same n in every prompt's sampling_params."""
        params = self.sampling_params
        if isinstance(params, list):
            return params[0].n if params else 1
        return params.n if params is not None else 1

    def fields_sent(self) -> list[str]:
        """The fields this request set, sampling parameters as `sampling_params.name`."""
        sent = sorted(self.model_fields_set)
        params = self.sampling_params
        for p in params if isinstance(params, list) else [params] if params else []:
            sent += [f"sampling_params.{n}" for n in sorted(p.model_fields_set)]
        return sorted(set(sent))

    def fields_unhonoured(self) -> list[str]:
        """The fields this request set that have no effect here (the ignored kind)."""
        params = self.sampling_params
        found = self.fields_of_kind("ignored")
        for p in params if isinstance(params, list) else [params] if params else []:
            found += [f"sampling_params.{n}" for n in p.fields_of_kind("ignored")]
        return sorted(set(found))

    def prompts(self) -> list[Prompt]:
        """One Prompt per engine request: every prompt n times (prompt-major, as SGLang)."""
        self.check_supported()
        texts = self.text if self.text is not None else self.input_ids
        batch = texts if isinstance(texts, list) and texts and not _is_ids(texts) else [texts]
        num = len(batch)
        params = _per_prompt(self.sampling_params, num, "sampling_params", SGLangSamplingParams())
        for p in params:
            p.check_supported("sampling_params.")
        n = self.samples_per_prompt
        if any(p.n != n for p in params):
            raise InvalidRequestError("n must be the same in every sampling_params")
        return_logprob = _per_prompt(self.return_logprob, num, "return_logprob", False)
        start = _per_prompt(self.logprob_start_len, num, "logprob_start_len", -1)
        top = _per_prompt(self.top_logprobs_num, num, "top_logprobs_num", 0)
        salts = zip(
            _per_prompt(self.namespace, num, "namespace", None),
            _per_prompt(self.cache_salt, num, "cache_salt", None),
            _per_prompt(self.extra_key, num, "extra_key", None),
            strict=True,
        )
        salt = ["/".join(s for s in parts if s) or None for parts in salts]
        rids = self._rids(num, n)
        return [
            Prompt(
                rids[i * n + j],
                batch[i],
                params[i],
                return_logprob[i],
                start[i],
                top[i],
                salt[i],
                i,
                j,
            )
            for i in range(num)
            for j in range(n)
        ]

    def _rids(self, num_prompts: int, n: int) -> list[str | None]:
        total = num_prompts * n
        if self.rid is None:
            return [None] * total
        if isinstance(self.rid, str):
            return [self.rid] if total == 1 else [f"{self.rid}_{k}" for k in range(total)]
        if len(self.rid) != num_prompts:
            raise InvalidRequestError(f"rid has {len(self.rid)} ids for {num_prompts} prompts")
        if len(set(self.rid)) != len(self.rid):
            raise InvalidRequestError(f"duplicate request ids in rid: {self.rid}")
        return [rid if n == 1 else f"{rid}_{j}" for rid in self.rid for j in range(n)]


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias with its keys (token ids as strings) as ints; another key is a 400."""
    biases = {}
    for key, bias in (logit_bias or {}).items():
        try:
            biases[int(key)] = bias
        except ValueError as err:
            raise InvalidRequestError(
                f"logit_bias keys are token ids (as strings), got {key!r}"
            ) from err
    return biases


def common_sampling_fields(body: Any) -> dict[str, Any]:
    """The SamplingParams fields that SGLang's and OpenAI's bodies name and mean alike, read
    off `body`: both APIs map them the same way (top_k -1 is "none", as the engine's 0)."""
    return {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": max(0, body.top_k),
        "min_p": body.min_p,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "repetition_penalty": body.repetition_penalty,
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids or [],
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "logit_bias": token_biases(body.logit_bias),
    }


def _is_ids(value: list) -> bool:
    return bool(value) and isinstance(value[0], int)


def _per_prompt(value: Any, num: int, name: str, default: Any) -> list:
    """A per-request field given once or as a list: one value per prompt."""
    if value is None:
        return [default] * num
    if not isinstance(value, list):
        return [value] * num
    if len(value) != num:
        raise InvalidRequestError(f"{name} has {len(value)} entries for {num} prompts")
    return value


def constraint_of(
    regex: str | None = None,
    json_schema: str | dict | None = None,
    grammar: str | None = None,
    structural_tag: str | dict | None = None,
) -> Constraint | None:
    """At most one constraint from SGLang-style fields (json_schema and structural_tag may be
    JSON strings)."""
    json_schema = _json_field(json_schema, "json_schema")
    structural_tag = _json_field(structural_tag, "structural_tag")
    if structural_tag is not None:
        structural_tag = structural_tag_of(structural_tag)
    given = {
        k: v
        for k, v in (
            ("regex", regex),
            ("json_schema", json_schema),
            ("grammar", grammar),
            ("structural_tag", structural_tag),
        )
        if v is not None
    }
    if not given:
        return None
    with invalid_input():
        return Constraint(**given)


def _json_field(value: str | dict | None, name: str) -> dict | None:
    """A field SGLang takes as a JSON string (or, from flowlang, as an object)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise InvalidRequestError(f"{name} is not valid JSON: {err}") from err
    except RecursionError as err:  # Python's decoder recurses per level
        raise InvalidRequestError(f"{name} nests too deeply to read") from err


def structural_tag_of(tag: Any) -> dict:
    """xgrammar's structural tag from SGLang's field: the current form as it is, the legacy
    `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` as triggered tags."""
    if not isinstance(tag, dict):
        raise InvalidRequestError("structural_tag must be a JSON object")
    if "format" in tag:
        return {"type": "structural_tag", **tag}
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise InvalidRequestError(
            "structural_tag needs a 'format' (xgrammar's form) or 'structures' and 'triggers' "
            "(SGLang's legacy form)"
        )
    try:
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s["schema"]},
                "end": s["end"],
            }
            for s in structures
        ]
    except (KeyError, TypeError) as err:
        raise InvalidRequestError(
            f"structural_tag structures need begin, schema and end: missing {err}"
        ) from err
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags},
    }
