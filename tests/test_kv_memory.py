"""The KV pool a newcomer gets: sized to a share of memory up to a cap (EngineConfig), and on
CPU resident only as rows are written (KVPool), with the size and its knob in the summary."""

from __future__ import annotations

import resource
import types

import pytest
import torch
from pydantic import ValidationError

from runtime import config as config_module
from runtime.cache.pool import KVPool
from runtime.config import EngineConfig
from runtime.summary import EngineSummary

GiB = 2**30
BYTES_PER_TOKEN = 46_080  # SmolLM2-135M in fp32: 30 layers x K and V x 3 heads x 64 x 4 bytes


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize(
    ("available_gib", "settings", "expected_bytes"),
    [
        (64, {}, 4 * GiB),  # a big machine: the cap
        (8, {}, int(8 * GiB * 0.3)),  # a small one: the share
        (64, {"kv_memory_cap_gib": 1.5}, int(1.5 * GiB)),
        (64, {"kv_memory_fraction": 0.01}, int(64 * GiB * 0.01)),
    ],
)
def test_the_default_pool_is_a_share_of_memory_up_to_the_cap(
    monkeypatch, available_gib, settings, expected_bytes
):
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: available_gib * GiB)
    num_slots = EngineConfig(**settings).num_kv_slots(BYTES_PER_TOKEN)
    assert num_slots == expected_bytes // BYTES_PER_TOKEN


def test_max_kv_tokens_overrides_the_cap(monkeypatch):
    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 64 * GiB)
    config = EngineConfig(max_kv_tokens=200_000, page_size=16)
    assert config.num_kv_slots(BYTES_PER_TOKEN) == 200_000  # 8.6 GB: asked for, so given


@pytest.mark.parametrize("cap_gib", [0, -1.0])
def test_the_cap_is_validated(cap_gib):
    with pytest.raises(ValidationError, match="kv_memory_cap_gib"):
        EngineConfig(kv_memory_cap_gib=cap_gib)


def test_a_cpu_pool_becomes_resident_only_as_rows_are_written():
    torch.ones(1).add_(1)  # torch's own lazy setup happens before the measurement
    before = resident_bytes()
    # 2 layers x 2**17 slots x 4 heads x 128 x 4 bytes = 512 MiB each for K and V: 1 GiB
    pool = KVPool(num_layers=2, num_slots=2**17, num_kv_heads=4, head_dim=128)
    assert pool.nbytes == GiB
    assert resident_bytes() - before < 64 * 2**20
    rows = torch.arange(0, 2**17, 4096)  # 32 rows spread over the pool
    k = torch.randn(len(rows), 4, 128)
    pool.write(1, rows, k, -k)
    assert torch.equal(pool.k[1][rows], k) and torch.equal(pool.v[1][rows], -k)
    assert resident_bytes() - before < 64 * 2**20  # a page or so per row written
    untouched = pool.k[0][:4096]
    assert untouched.count_nonzero() == 0 and pool.v[1][1:4096].count_nonzero() == 0
    del pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_rows_read_back_what_was_written_scratch_rows_included(dtype):
    pool = KVPool(3, 64, 2, 8, dtype, scratch_slots=4)
    assert pool.k[2].shape == (68, 2, 8) and pool.k[2].dtype == dtype
    assert pool.k[2].is_contiguous() and pool.nbytes == 2 * 3 * 68 * 2 * 8 * dtype.itemsize
    assert all(t.count_nonzero() == 0 for t in (*pool.k, *pool.v))
    rows = torch.tensor([0, 17, 63, pool.scratch_slot + 3])
    k, v = torch.randn(4, 2, 8).to(dtype), torch.randn(4, 2, 8).to(dtype)
    pool.write(2, rows, k, v)
    assert torch.equal(pool.k[2][rows], k) and torch.equal(pool.v[2][rows], v)
    assert pool.k[1].count_nonzero() == 0  # other layers untouched
    assert pool.k[2].count_nonzero() == k.count_nonzero()


def test_the_summary_gives_the_pool_size_and_names_the_knob():
    pool = KVPool(30, 93_206, 3, 64)  # the 4 GiB default for SmolLM2-135M in fp32
    arch = types.SimpleNamespace(model_type="llama", num_layers=30)
    lines = EngineSummary.of(EngineConfig(), arch, pool, "torch", "/models/smollm2").lines()
    text = "\n".join(lines)
    assert "model      smollm2-135m-instruct (/models/smollm2)" in text
    assert "family     llama, 30 layers" in text
    assert "device     cpu, float32, attention backend torch" in text
    assert "KV pool    93,206 tokens, 4.00 GiB, resident only as used" in text
    assert "30% of available memory, at most 4 GiB; --max-kv-tokens sets it" in text
    assert any(line.startswith("kernels    ") and line[11:].strip() for line in lines)
    sized = EngineSummary.of(EngineConfig(max_kv_tokens=1024), arch, pool, "cpu", None)
    assert "set by --max-kv-tokens" in sized.render() and "(random weights)" in sized.render()
