"""What an Engine is built from: the model (weights, architecture, tokenizer, runner and its KV
pool), the KV tiers below the pool, and the loop thread's CPU share. Kept out of engine.py so
that the Engine class reads as its step and its API; `Engine.__init__` calls these in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.cache.chunks import TierLayout
from runtime.cache.lower import LowerTiers, NoTiers
from runtime.cache.pool import KVPool
from runtime.cache.tiers import KVTiers
from runtime.config import EngineConfig
from runtime.cpu_share import CpuShare
from runtime.model.arch import ModelArch
from runtime.model.gguf_blocks import configured_blocks, model_blocks
from runtime.model.loader import checkpoint_digest, load_checkpoint, load_tokenizer
from runtime.model.native.kernels import release_openmp_workers
from runtime.model.native.kernels import start_building as start_building_kernels
from runtime.model.quantize_blocks import quantize_checkpoint
from runtime.model.registry import check_model_name, resolve_model
from runtime.model.runner import ModelRunner


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: its runner holds the weights and the KV pool."""

    arch: ModelArch
    runner: ModelRunner
    tokenizer: Any  # None: random weights, or a checkpoint without a usable tokenizer
    path: str | None  # None: random weights


def load_model(config: EngineConfig) -> LoadedModel:
    """Weights, architecture, tokenizer, and the runner with its KV pool."""
    random = config.model.startswith("random:")
    if not random:
        check_model_name(config.model)  # a typo fails here, before any kernel build
    if config.device == "cpu":
        start_building_kernels()  # compiles (first run only) while the model loads
    if random:
        from runtime.model.random_weights import random_checkpoint

        checkpoint = random_checkpoint(
            config.model, getattr(torch, config.dtype), config.device, config.seed
        )
        tokenizer, path = None, None
        # random weights come from no file: asking for blocks is refused by model_blocks
        blocks = model_blocks(config.model) if config.gguf_blocks else {}
    else:
        resolved = resolve_model(config.model)
        checkpoint = load_checkpoint(resolved)
        tokenizer, path = _maybe_tokenizer(resolved), str(resolved)
        blocks = {}
        if config.quantize is None:  # else new blocks are made from the weights, below
            device = torch.device(config.device)
            blocks = configured_blocks(config.model, config.gguf_blocks, device)
    arch = ModelArch.from_hf(checkpoint.hf_config)
    if config.quantize is not None:
        blocks = quantize_checkpoint(
            checkpoint.weights, arch.num_layers, arch.tie_word_embeddings, config.quantize
        )
    num_slots = config.num_kv_slots(arch.kv_bytes_per_token(config.dtype))
    runner = ModelRunner(arch, checkpoint.weights, num_slots, config, blocks)
    return LoadedModel(arch, runner, tokenizer, path)


def make_tiers(config: EngineConfig, pool: KVPool, model_path: str | None) -> LowerTiers:
    """L2 (host memory) and L3 (disk) under the pool, when configured."""
    if config.disable_radix_cache or not (config.host_kv_gb or config.disk_kv_dir):
        return NoTiers()
    layout = TierLayout(
        model=weights_identity(config, model_path),
        num_layers=pool.num_layers,
        num_kv_heads=pool.k[0].shape[1],
        head_dim=pool.k[0].shape[2],
        dtype=pool.dtype,
        page_size=config.page_size,
    )
    return KVTiers(
        pool,
        layout,
        host_bytes=int(config.host_kv_gb * 2**30),
        disk_dir=config.disk_kv_dir,
        disk_bytes=int(config.disk_kv_gb * 2**30),
        write_policy=config.kv_write_policy,
    )


def weights_identity(config: EngineConfig, model_path: str | None) -> str:
    """What names these weights for the disk tier: the model as given, plus a digest of its
    weights' bytes and its config (random weights: their seed), and the blocks they are
    quantized to at load (other weights: other KV), and activations rounded to int8 (other KV
    too: the K and V projections see the rounded activations)."""
    quantized = "" if config.quantize is None else f"|quantize={config.quantize}"
    quantized += "|activations=int8" if config.quantize_activations else ""
    if model_path is None:
        return f"{config.model}|seed={config.seed}{quantized}"
    return f"{config.model}|{checkpoint_digest(model_path)}{quantized}"


def loop_cpu_share(config: EngineConfig, runner: ModelRunner) -> CpuShare | None:
    """Ready the loop thread's CPU: on a CPU device, the building thread's OpenMP workers are
    released, and (adapt_cpu_threads) the thread count follows the cores left free."""
    if runner.device.type != "cpu":
        return None
    # this thread's OpenMP workers (from building the model) would throttle the loop thread's:
    # every parallel region of a step would pay a futex wake-up
    release_openmp_workers()
    return CpuShare.for_this_process() if config.adapt_cpu_threads else None


def _maybe_tokenizer(path) -> Any:
    try:
        return load_tokenizer(path)
    except (OSError, ValueError, TypeError):
        return None
