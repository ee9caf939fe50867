"""The native CPU attention kernel (csrc/paged_attention.cpp), compiled on first use, cached.

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

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"


class KernelBuildError(RuntimeError):
    """The native kernel could not be compiled here."""


@functools.cache
def load_cpu_kernels() -> Any:
    """The ops namespace with `paged_attention(q, k_pool, v_pool, slots, kv_indptr, qo_indptr,
    scale, window, softcap)`; softcap 0 leaves the scores uncapped."""
    import torch
    from torch.utils.cpp_extension import load

    started = time.perf_counter()
    # named by the source's hash: processes built from different sources (a checkout of an
    # older commit) never load or overwrite each other's builds in torch's extension cache
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    try:
        load(
            name=f"flowlang_cpu_attention_{digest}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.flowlang.*
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as err:
        raise KernelBuildError(f"building the CPU attention kernel failed: {err}") from err
    elapsed = time.perf_counter() - started
    if elapsed > 2:
        print(
            f"[flowlang] compiled the CPU attention kernel in {elapsed:.0f} s (cached now)",
            file=sys.stderr,
            flush=True,
        )
    return torch.ops.flowlang
