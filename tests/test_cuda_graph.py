"""Decode-graph bookkeeping on CPU: capture sizes, padding into the scratch page, static inputs,
flashinfer's page tables. `EagerStep` stands in for a captured graph, so the same DecodeGraphs
that replays CUDA graphs on a GPU runs here over the torch backend and must match eager."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.cache.allocator import SlotAllocator
from runtime.cache.pool import KVPool
from runtime.config import EngineConfig
from runtime.model.arch import ModelArch
from runtime.model.attention.flashinfer_backend import page_table
from runtime.model.attention.torch_backend import TorchAttention
from runtime.model.batch import ForwardBatch
from runtime.model.cuda_graph import (
    DecodeGraphs,
    EagerStep,
    capture_batch_sizes,
    is_plain_decode,
    pad_decode_batch,
    padded_batch_size,
)
from runtime.model.llama import LlamaModel
from runtime.model.random_weights import random_checkpoint
from runtime.model.runner import ModelRunner


@given(st.integers(1, 600))
def test_capture_sizes_cover_every_batch_with_bounded_padding(max_batch_size):
    sizes = capture_batch_sizes(max_batch_size)
    assert sizes[0] == 1 and sizes[-1] == max_batch_size
    assert list(sizes) == sorted(set(sizes))
    assert {1, 2, 4, 8} & set(range(max_batch_size + 1)) <= set(sizes)
    for n in range(1, max_batch_size + 1):
        size = padded_batch_size(n, sizes)
        assert size == min(s for s in sizes if s >= n)
        if n > 8:
            assert size < 1.5 * n  # padding wastes less than a third of the step
    assert padded_batch_size(max_batch_size + 1, sizes) is None


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 4, 16]),
    st.lists(st.integers(1, 70), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_page_table_describes_each_sequence_exactly(page_size, lengths, rng):
    alloc = SlotAllocator(512, page_size)
    seqs = []
    for n in lengths:
        pages = alloc.alloc(-(-n // page_size) * page_size).view(-1, page_size)
        order = list(range(pages.shape[0]))
        rng.shuffle(order)  # pages of a sequence need not be in order or adjacent
        seqs.append(pages[order].reshape(-1)[:n])
    indptr, indices, last = page_table(tuple(seqs), page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    for i, slots in enumerate(seqs):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        rebuilt = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        rebuilt = rebuilt[: (len(pages) - 1) * page_size + int(last[i])]
        assert torch.equal(rebuilt, slots)
        assert 1 <= int(last[i]) <= page_size


def _decode_batch(slots: list[torch.Tensor], tokens: list[int]) -> ForwardBatch:
    return ForwardBatch.build([[t] for t in tokens], slots)


def test_padding_goes_to_the_scratch_slot():
    slots = [torch.arange(0, 5), torch.arange(8, 11)]
    batch = _decode_batch(slots, [3, 4])
    assert is_plain_decode(batch)
    padded = pad_decode_batch(batch, 4, scratch_slot=64)
    assert padded.num_seqs == 4 and padded.input_ids.tolist() == [3, 4, 0, 0]
    assert padded.positions.tolist() == [4, 2, 0, 0]
    assert padded.out_slots.tolist() == [4, 10, 64, 64]
    assert [s.tolist() for s in padded.kv_slots[2:]] == [[64], [64]]
    assert padded.logit_rows.tolist() == [0, 1, 2, 3]
    assert pad_decode_batch(batch, 2, 64) is batch
    with pytest.raises(ValueError, match="does not fit"):
        pad_decode_batch(batch, 1, 64)
    extend = ForwardBatch.build([[1, 2]], [torch.arange(2)])
    assert not is_plain_decode(extend)
    scoring = ForwardBatch.build([[1]], [torch.arange(3)], all_logits=[True])
    assert is_plain_decode(scoring)  # one new token, its logits: the same computation


def _tiny_model():
    checkpoint = random_checkpoint("random:tiny", torch.float32, "cpu")
    arch = ModelArch.from_hf(checkpoint.hf_config)
    return arch, LlamaModel(arch, checkpoint.weights)


def _prefilled_pool(arch, model, scratch_slots, lengths, seed=0):
    """A pool holding prompts of `lengths`, their slot lists (one spare slot each for the
    decode) and their next tokens."""
    pool = KVPool(
        arch.num_layers, 256, arch.num_kv_heads, arch.head_dim, scratch_slots=scratch_slots
    )
    attn = TorchAttention(pool, arch.sliding_windows)
    gen = torch.Generator().manual_seed(seed)
    alloc = SlotAllocator(256)
    slots, prompts = [], []
    for n in lengths:
        slots.append(alloc.alloc(n + 1))
        prompts.append(torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist())
    prefill = ForwardBatch.build(prompts, [s[:-1] for s in slots])
    attn.plan(prefill)
    model.forward(prefill, attn)
    next_tokens = torch.randint(3, arch.vocab_size, (len(lengths),), generator=gen).tolist()
    return pool, attn, slots, next_tokens


@pytest.mark.parametrize("lengths", [[7], [5, 9, 12], [3, 4, 5, 6, 7, 8], [2] * 9])
def test_eager_stand_in_equals_the_plain_forward(lengths):
    """Padded, through static buffers, at a captured size: the same logits and the same pool
    as the plain eager forward; padding writes the scratch slot and nothing else."""
    arch, model = _tiny_model()
    pool, attn, slots, tokens = _prefilled_pool(arch, model, 1, lengths)
    ref_pool, ref_attn, _, _ = _prefilled_pool(arch, model, 1, lengths)
    graphs = DecodeGraphs(model, attn, pool, max_batch_size=8, step_type=EagerStep)
    batch = _decode_batch(slots, tokens)
    assert graphs.can_run(batch) == (len(lengths) <= 8)
    if not graphs.can_run(batch):
        return  # above the largest size: the runner runs it eagerly
    pool.k[0][pool.scratch_slot] = 7.0  # whatever padding leaves there is never read back
    logits = graphs.run(batch)
    ref_attn.plan(batch)
    expected = model.forward(batch, ref_attn)
    assert logits.shape == (len(lengths), arch.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    used = pool.num_slots
    for layer in range(arch.num_layers):
        torch.testing.assert_close(pool.k[layer][:used], ref_pool.k[layer][:used])
        torch.testing.assert_close(pool.v[layer][:used], ref_pool.v[layer][:used])
    assert graphs.num_replays == 1


def test_graphs_need_a_scratch_page():
    arch, model = _tiny_model()
    pool = KVPool(arch.num_layers, 64, arch.num_kv_heads, arch.head_dim)
    with pytest.raises(ValueError, match="scratch page"):
        DecodeGraphs(model, TorchAttention(pool, arch.sliding_windows), pool, 4, EagerStep)


def test_no_graphs_on_cpu_and_a_switch_in_the_config():
    checkpoint = random_checkpoint("random:tiny", torch.float32, "cpu")
    arch = ModelArch.from_hf(checkpoint.hf_config)
    runner = ModelRunner(arch, checkpoint.weights, 64, EngineConfig(attention_backend="torch"))
    assert runner.decode_graphs is None and runner.pool.scratch_slots == 0
    assert runner.num_graph_replays == 0
    config = EngineConfig(disable_cuda_graph=True, cuda_graph_max_batch_size=32)
    assert config.disable_cuda_graph and config.cuda_graph_max_batch_size == 32
    with pytest.raises(ValueError):
        EngineConfig(cuda_graph_max_batch_size=0)
