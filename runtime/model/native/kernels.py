"""The native CPU kernels (csrc/: paged and flash attention, the cascade merge, norms, RoPE,
SiLU-and-mul, the decode-batch GEMM), compiled on first use, cached.

torch.utils.cpp_extension builds it with the machine's compiler (-O3 -march=native, OpenMP
through ATen's parallel_for) into torch's extension cache; later processes load it in
milliseconds. A build failure raises with the compiler's message.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "flash.cpp",
        "merge_attention.cpp",
        "pointwise.cpp",
        "panel_gemm.cpp",
        "threads.cpp",
    )
]
_HEADERS = [Path(__file__).parent / "csrc" / "avx512_math.h"]


class KernelBuildError(RuntimeError):
    """The native kernel could not be compiled here."""


@functools.cache
def load_cpu_kernels() -> Any:
    """The ops namespace with `paged_attention(q, k_pool, v_pool, slots, kv_indptr, qo_indptr,
    scale, window, softcap)` (softcap 0 leaves the scores uncapped), and
    `flash_attention(q, k, v, scale, causal)` (bf16, fp32) where `native_flash_supported()`,
    with its two halves `flash_pack(k_pool, v_pool, slots)` (keys gathered by slot and packed
    for it) and `flash_attention_packed(q, q_rows, k_packed, v_packed, length, scale, causal)`
    (the query rows q_rows of q), `paged_decode_merge(q, k_pool, v_pool, slots, kv_indptr,
    rows, prefix_out, prefix_lse, scale, out)` (single-row decodes merged with a prefix's
    attention, written into out's rows), `merge_attention(out_a, lse_a, out_b, lse_b)`, and
    `rms_norm(x, weight, eps)`, `add_rms_norm(x, residual, weight, eps)`,
    `rope(x, cos, sin)`, `silu_and_mul(gate_up)`, and `panel_gemm(x, panels, bias, n_out)`
    over `panel_pack(w)`'s panels where `panel_gemm_supported()`, and
    `release_openmp_workers()` (the calling thread's OpenMP pool, see csrc/threads.cpp)."""
    import torch
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    # named by the source's hash: processes built from different sources (a checkout of an
    # older commit) never load or overwrite each other's builds in torch's extension cache
    source = b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])
    digest = hashlib.sha256(source).hexdigest()[:12]
    try:
        load(
            name=f"flowlang_cpu_attention_{digest}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.flowlang.*
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:
        raise KernelBuildError(f"building the CPU kernels failed: {err}") from err
    elapsed = time.perf_counter() - started
    if elapsed > 2:
        print(
            f"[flowlang] compiled the CPU kernels in {elapsed:.0f} s (cached now)",
            file=sys.stderr,
            flush=True,
        )
    return torch.ops.flowlang


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
