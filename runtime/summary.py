"""What an engine says about itself once it is up: which model (asked for, and where it was
found), its family, where and how it runs, the KV pool's size and the knob that sets it, and
where the CPU kernels come from. `flowlang serve`, `flowlang demo` and a cluster's front all
print the same lines (a cluster's from its first replica)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.cache.pool import KVPool
    from runtime.config import EngineConfig
    from runtime.model.arch import ModelArch


@dataclass(frozen=True)
class EngineSummary:
    """An engine's startup facts (plain values: a Ray replica sends it to the front).

    >>> summary = EngineSummary(
    ...     "m", None, "llama", 2, "cpu", "float32", "torch", 1024, 2**20, "--max-kv-tokens", "-"
    ... )
    >>> summary.lines()[0]
    'model      m (random weights)'
    """

    model: str  # as asked: a registry name, a path or a hub id
    model_path: str | None  # the folder or .gguf file it resolved to; None: random weights
    model_type: str  # config.json's model_type (the family)
    num_layers: int
    device: str
    dtype: str
    attention_backend: str
    num_kv_tokens: int  # slots the allocator hands out
    kv_pool_bytes: int  # K and V of every layer, reserved up front
    kv_sizing: str  # what set the pool's size, and the knob that changes it
    kernels: str  # where the CPU kernels come from, or why the torch path runs
    max_cpu_threads: int | None = None  # adapted to the cores others leave (runtime/cpu_share)
    num_replicas: int = 1
    kv_tiers: str | None = None  # host memory and disk below the pool (runtime/cache/tiers)
    weight_blocks: dict[str, int] | None = None  # tensors on GGUF blocks by type (gguf_blocks)

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        arch: ModelArch,
        pool: KVPool,
        attention_backend: str,
        model_path: str | None,
        max_cpu_threads: int | None = None,
        kv_tiers: str | None = None,
        weight_blocks: dict[str, int] | None = None,
    ) -> EngineSummary:
        """An engine's summary from its parts (cheap: nothing is loaded or measured)."""
        if config.max_kv_tokens is not None:
            sizing = "set by --max-kv-tokens"
        else:
            sizing = (
                f"default: {config.kv_memory_fraction:.0%} of available memory, at most "
                f"{config.kv_memory_cap_gib:g} GiB; --max-kv-tokens sets it"
            )
        return cls(
            model=config.model,
            model_path=model_path,
            model_type=arch.model_type,
            num_layers=arch.num_layers,
            device=str(pool.device),
            dtype=config.dtype,
            attention_backend=attention_backend,
            num_kv_tokens=pool.num_slots,
            kv_pool_bytes=pool.nbytes,
            kv_sizing=sizing,
            kernels=kernel_source(pool.device.type),
            max_cpu_threads=max_cpu_threads,
            kv_tiers=kv_tiers,
            weight_blocks=weight_blocks or None,
        )

    def lines(self) -> list[str]:
        """The summary, one fact a line."""
        if self.model_path is None:
            where = " (random weights)"
        elif self.model_path != self.model:
            where = f" ({self.model_path})"
        else:
            where = ""
        lazy = ", resident only as used" if self.device == "cpu" else ""
        lines = [
            f"model      {self.model}{where}",
            f"family     {self.model_type}, {self.num_layers} layers",
            f"device     {self.device}, {self.dtype}, attention backend {self.attention_backend}",
            f"KV pool    {self.num_kv_tokens:,} tokens, {_size(self.kv_pool_bytes)}{lazy}",
            f"           ({self.kv_sizing})",
            f"kernels    {self.kernels}",
        ]
        if self.kv_tiers is not None:
            lines.insert(5, f"KV below   {self.kv_tiers}")
        if self.weight_blocks:
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.weight_blocks.items()))
            lines.insert(3, f"weights    decode rows on GGUF blocks: {kinds} tensors")
            lines.insert(4, "           (--no-gguf-blocks: the dequantized weights throughout)")
        if self.max_cpu_threads is not None:
            lines.append(
                f"threads    {self.max_cpu_threads}, fewer while other processes use the cores"
            )
        if self.num_replicas > 1:
            lines.insert(0, f"replicas   {self.num_replicas}, each as below")
        return lines

    def render(self, prefix: str = "[flowlang] ") -> str:
        """The lines as one block, each behind `prefix`."""
        return "\n".join(prefix + line for line in self.lines())


def kernel_source(device_type: str) -> str:
    """Where the CPU kernels come from, or why the torch path runs."""
    if device_type != "cpu":
        return f"the CPU kernels are not used on {device_type}"
    from runtime.model.native.kernels import kernel_status

    return kernel_status()


def _size(num_bytes: int) -> str:
    if num_bytes >= 2**27:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"
