"""Attention backends, chosen by name. flashinfer is imported lazily and never on the CPU path."""

from __future__ import annotations

import sys

from runtime.cache.pool import KVPool
from runtime.model.attention.base import AttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")


def make_attention_backend(
    name: str, pool: KVPool, sliding_windows: tuple[int | None, ...]
) -> AttentionBackend:
    """The backend called `name` over `pool`; "auto" picks the fastest that works here.

    On CPU "auto" is the native kernel ("cpu"); if it cannot be compiled, the reference
    ("torch", same numerics) is used and the reason printed. The chosen name is `backend.name`.
    """
    if name == "auto":
        if pool.device.type != "cpu":
            name = "torch"  # the GPU issue makes "auto" prefer flashinfer on CUDA
        else:
            from runtime.model.attention.cpu_kernels import KernelBuildError, load_cpu_kernels

            try:
                load_cpu_kernels()
                name = "cpu"
            except KernelBuildError as err:
                print(f"[flowlang] {err}; using the torch attention backend", file=sys.stderr)
                name = "torch"
    if name == "cpu":
        if pool.device.type != "cpu":
            raise ValueError("the 'cpu' attention backend needs the pool on the CPU")
        from runtime.model.attention.torch_backend import CpuPagedAttention

        return CpuPagedAttention(pool, sliding_windows)
    if name == "torch":
        from runtime.model.attention.torch_backend import TorchAttention

        return TorchAttention(pool, sliding_windows)
    if name == "flashinfer":
        if pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device; use 'torch'")
        raise NotImplementedError(
            "the flashinfer backend is not implemented yet (see the GPU issue); use 'torch'"
        )
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
