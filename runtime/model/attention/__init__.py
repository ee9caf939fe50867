"""Attention backends, chosen by name. flashinfer is imported lazily and never on the CPU path."""

from __future__ import annotations

from runtime.cache.pool import KVPool
from runtime.model.attention.base import AttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flashinfer")


def choose_backend(device_type: str, flashinfer_importable: bool) -> str:
    """What "auto" means where: flashinfer on CUDA when it is installed, else the torch
    reference (it runs on CUDA too); the native kernel on CPU."""
    if device_type == "cuda":
        return "flashinfer" if flashinfer_importable else "torch"
    return "cpu"


def flashinfer_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


def make_attention_backend(
    name: str,
    pool: KVPool,
    sliding_windows: tuple[int | None, ...],
    num_heads: int = 0,
    page_size: int = 1,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The backend called `name` over `pool`; "auto" picks the fastest that works here.

    On CPU "auto" is the native kernel ("cpu"); if it cannot be built, the reference
    ("torch", same numerics) is used (runtime.model.native.kernels says why, once). On CUDA
    it is flashinfer when installed, else torch. The chosen name is `backend.name` (and in
    the engine's stats). `batch_invariant`: the CPU backend attends each row as its sequence
    alone would (the other backends are not checked for it).
    """
    if name == "auto":
        # flashinfer takes one window for every layer (Gemma's alternate: the reference then)
        uniform = len(set(sliding_windows)) <= 1
        name = choose_backend(
            pool.device.type, pool.device.type == "cuda" and uniform and flashinfer_importable()
        )
        if name == "cpu":
            from runtime.model.native.kernels import KernelBuildError, load_cpu_kernels

            try:
                load_cpu_kernels()
            except KernelBuildError:  # the kernels said why, once
                name = "torch"
    if name == "cpu":
        if pool.device.type != "cpu":
            raise ValueError("the 'cpu' attention backend needs the pool on the CPU")
        from runtime.model.attention.cpu_backend import CpuPagedAttention

        return CpuPagedAttention(pool, sliding_windows, softcap, batch_invariant)
    if name == "torch":
        from runtime.model.attention.torch_backend import TorchAttention

        return TorchAttention(pool, sliding_windows, softcap)
    if name == "flashinfer":
        if pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device; use 'torch'")
        from runtime.model.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(pool, sliding_windows, num_heads, page_size, softcap)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
