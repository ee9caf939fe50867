"""The native CPU kernels (csrc/: paged and flash attention, the cascade merge, norms, RoPE,
SiLU-and-mul, the decode-batch GEMM, the GEMM over GGUF Q8_0 / Q4_1 / Q4_0 / Q5_0 / Q4_K / Q6_K
weights, and a decode step's layers calling them in one op): built once per machine and torch
build (build.py), loaded in milliseconds afterwards.

`start_building()` begins the build (or the load of a cached one) on a background thread, so an
engine compiles while its model is fetched and loaded; `load_cpu_kernels()` waits for it. Where
they cannot be built (no compiler, a failed build, FLOWLANG_NATIVE_KERNELS=0) the reason is said
once and every caller falls back to the torch path, which computes the same results.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any

from runtime.model.native import build
from runtime.model.native.build import KernelBuildError

__all__ = [
    "GGML_Q4_0",
    "GGML_Q4_1",
    "GGML_Q4_K",
    "GGML_Q5_0",
    "GGML_Q6_K",
    "GGML_Q8_0",
    "KernelBuildError",
    "kernel_status",
    "load_cpu_kernels",
    "native_flash_supported",
    "release_openmp_workers",
    "start_building",
]

DISABLE_VAR = "FLOWLANG_NATIVE_KERNELS"
# new rows of one sequence the paged kernels take as single-row decodes, bit for bit (a draft
# of up to 15 and its real token): csrc/paged_attention.cpp's kMaxDecodeRows
MAX_DECODE_ROWS = 16
# keys a batch-invariant engine's decodes attend per chunk, merging chunk results in order, so that
# a shared prefix of whole chunks attended once continues exactly: paged_attention.cpp's kKvChunk
KV_CHUNK = 64
PROGRESS_EVERY_S = 30.0
# the GGUF block formats quant_pack / quant_gemm take (GGMLQuantizationType's values)
GGML_Q4_0 = 2
GGML_Q4_1 = 3
GGML_Q5_0 = 6
GGML_Q8_0 = 8
GGML_Q4_K = 12  # super-blocks of 256: n_in a multiple of 256
GGML_Q6_K = 14


class _Kernels:
    """The process's one build and load: started once, its outcome (ops or error) kept. A
    watcher thread loads a cached build, or waits for a build process and reports on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: KernelBuildError | None = None
        self._key: build.BuildKey | None = None
        self._started = time.monotonic()
        self.status = "not loaded yet"

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kernel-build")
                self._thread.daemon = True
                self._thread.start()

    def wait(self) -> Any:
        self.start()
        if self._thread.is_alive() and self._key is not None:
            build.say(f"waiting for the CPU kernels to finish compiling ({self._progress()})")
        self._thread.join()
        if self._error is not None:
            raise self._error
        import torch

        return torch.ops.flowlang

    def _progress(self) -> str:
        done = build.files_compiled(self._key)
        return f"{done} of {len(build.SOURCES)} files, {time.monotonic() - self._started:.0f} s"

    def _run(self) -> None:
        try:
            self.status = self._build_or_load()
        except KernelBuildError as err:
            self._error = err
            self.status = f"torch path: {err}"
            build.say(f"{err}; running on the torch path (same results, slower)")

    def _build_or_load(self) -> str:
        """Where the loaded kernels came from."""
        if os.environ.get(DISABLE_VAR, "1").strip().lower() in ("0", "off", "false", "no"):
            raise KernelBuildError(f"the native CPU kernels are disabled ({DISABLE_VAR}=0)")
        compiler = build.find_compiler()
        if compiler is None:
            raise KernelBuildError(
                f"no C++ compiler ({os.environ.get('CXX') or 'c++'}) found to build the native "
                f"CPU kernels (Debian/Ubuntu: apt-get install g++)"
            )
        key = build.BuildKey.here(compiler)
        if key.library is not None:
            build.load_library(key.library)
            return f"native (cached build {key.folder})"
        self._started = time.monotonic()
        with build.build_lock(key, build.say):
            if key.library is not None:  # built while we waited
                build.load_library(key.library)
                return f"native (built by another process: {key.folder})"
            build.say(
                f"compiling the native CPU kernels for this CPU and torch build (once; about a "
                f"minute on 2 cores) into {key.folder}"
            )
            self._key = key
            child = build.start_build(key)
            while True:
                try:
                    child.wait(PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    build.say(f"compiling the CPU kernels: {self._progress()}")
            if child.returncode != 0 or key.library is None:
                raise build.failure(key)
        build.load_library(key.library)
        elapsed_s = time.monotonic() - self._started
        build.say(f"compiled the CPU kernels in {elapsed_s:.0f} s; cached in {key.folder}")
        return f"native (compiled now in {elapsed_s:.0f} s: {key.folder})"


_KERNELS = _Kernels()


def start_building() -> None:
    """Begin building (or loading) the kernels on a background thread; returns at once."""
    _KERNELS.start()


def load_cpu_kernels() -> Any:
    """The ops namespace (waits for the build): `paged_attention(q, k_pool, v_pool, slots,
    kv_indptr, qo_indptr, scale, window, softcap, kv_chunk)` (softcap 0 leaves the scores
    uncapped; kv_chunk 0 attends a sequence's keys at once, KV_CHUNK as batch-invariant), and
    `flash_attention(q, k, v, scale, causal)` (bf16, fp32) where `native_flash_supported()`,
    with its two halves `flash_pack(k_pool, v_pool, slots)` (keys gathered by slot and packed
    for it) and `flash_attention_packed(q, q_rows, k_packed, v_packed, length, scale, causal)`
    (the query rows q_rows of q), `paged_decode_merge(q, k_pool, v_pool, slots, kv_indptr,
    qo_indptr, rows, prefix_out, prefix_lse, scale, kv_chunk, out)` (decodes of up to 16 rows
    each, continuing their fp32 attention over a shared prefix, written into out's rows; behind
    `prefix_attention(q, rows, k_pool, v_pool, prefix_slots, scale)`'s whole KV_CHUNKs with
    kv_chunk KV_CHUNK, each row is what its sequence alone gets),
    `merge_attention(out_a, lse_a, out_b, lse_b)`, and
    `rms_norm(x, weight, eps)`, `add_rms_norm(x, residual, weight, eps)`,
    `rope(x, cos, sin)`, `silu_and_mul(gate_up)`, and `panel_gemm(x, panels, bias, n_out)`
    over `panel_pack(w)`'s panels where `panel_gemm_supported()`,
    `quant_gemm(x, packed, type, bias, n_out, quantize_x=False, rows_alike=False)` over
    `quant_pack(raw, type, n_out, n_in)`'s groups of a weight's GGUF bytes (type GGML_Q8_0,
    GGML_Q4_1, GGML_Q4_0, GGML_Q5_0, GGML_Q4_K or GGML_Q6_K; the K types need n_in a multiple
    of 256; quantize_x: x to int8 per 32-block, VNNI; rows_alike: each row summed as it would
    be alone, for batch invariance and exact speculation) where `quant_gemm_supported()`, and
    `release_openmp_workers()` (the calling thread's OpenMP pool, see csrc/threads.cpp).
    Raises KernelBuildError (the same one every time) where they cannot be had."""
    return _KERNELS.wait()


def kernel_status() -> str:
    """One line for startup summaries: where the kernels come from, or why the torch path."""
    return _KERNELS.status


def native_flash_supported() -> bool:
    """Whether this CPU runs the native flash kernel (built where it has AVX-512 BF16)."""
    return bool(load_cpu_kernels().native_flash_supported())


def release_openmp_workers() -> None:
    """Release the calling thread's OpenMP workers (csrc/threads.cpp: why), where the native
    kernels are built; a thread that runs parallel work again gets a fresh pool."""
    try:
        ops = load_cpu_kernels()
    except KernelBuildError:
        return
    ops.release_openmp_workers()
