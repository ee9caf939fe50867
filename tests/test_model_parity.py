"""Our decoder vs transformers' on the same random weights (fp32, |diff| < 1e-4), per family."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_hf_model

from runtime.cache.allocator import SlotAllocator
from runtime.config import EngineConfig
from runtime.model.arch import ModelArch
from runtime.model.batch import ForwardBatch
from runtime.model.runner import ModelRunner

FAMILIES = ["llama", "llama3", "qwen2", "mistral", "qwen3", "phi3", "phi3-longrope"]
FAMILIES += ["mixtral", "qwen3-moe", "gemma2", "gemma3"]
BACKENDS = ["torch", "cpu"]  # the reference, and the native paged decode kernel
TOL = 1e-4


def make(kind: str, backend: str = "torch"):
    hf = tiny_hf_model(kind)
    arch = ModelArch.from_hf(hf.config)
    runner = ModelRunner(arch, hf.state_dict(), 2048, EngineConfig(attention_backend=backend))
    assert runner.attention.name == backend
    return hf, runner, SlotAllocator(2048)


@torch.no_grad()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0]


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_matches(kind):
    hf, runner, alloc = make(kind)
    ids = torch.randint(0, 512, (57,)).tolist()
    batch = ForwardBatch.build([ids], [alloc.alloc(57)], all_logits=[True])
    assert close(runner.forward(batch), hf_logits(hf, ids)) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_extend_after_cached_prefix_at_random_splits(kind, backend):
    hf, runner, alloc = make(kind, backend)
    rng = random.Random(kind)
    ids = [rng.randrange(512) for _ in range(70)]
    ref = hf_logits(hf, ids)
    for _ in range(4):
        cut = sorted(rng.sample(range(1, 70), 2))
        slots = alloc.alloc(70)
        # the prefix arrives in two earlier extends, then the rest as one extend
        runner.forward(ForwardBatch.build([ids[: cut[0]]], [slots[: cut[0]]]))
        runner.forward(ForwardBatch.build([ids[cut[0] : cut[1]]], [slots[: cut[1]]]))
        out = runner.forward(ForwardBatch.build([ids[cut[1] :]], [slots], all_logits=[True]))
        assert close(out, ref[cut[1] :]) < TOL, cut
        alloc.free(slots)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_sixteen_decode_steps(kind, backend):
    hf, runner, alloc = make(kind, backend)
    ids = torch.randint(0, 512, (20,)).tolist()
    slots = alloc.alloc(20)
    logits = runner.forward(ForwardBatch.build([ids], [slots]))
    for _ in range(16):  # 16 greedy decode steps, each checked against a full HF forward
        ref = hf_logits(hf, ids)[-1]
        assert close(logits[0], ref) < TOL
        ids.append(int(logits[0].argmax()))
        slots = torch.cat([slots, alloc.alloc(1)])
        logits = runner.forward(ForwardBatch.build([ids[-1:]], [slots]))
    assert close(logits[0], hf_logits(hf, ids)[-1]) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_mixed_batch_of_extends_and_decodes(kind, backend):
    """Fresh prefills, extends after prefixes and decodes of different lengths in one forward."""
    hf, runner, alloc = make(kind, backend)
    rng = random.Random(1)
    seqs = [[rng.randrange(512) for _ in range(n)] for n in (5, 33, 48, 12, 40, 1)]
    cached = [0, 20, 47, 11, 39, 0]  # 47/11/39: decodes of one token; 20: extend; 0: prefill
    # scattered slots, as after eviction churn
    order = torch.randperm(2048)
    slots, start = [], 0
    for s in seqs:
        slots.append(order[start : start + len(s)])
        start += len(s)
    for s, c, sl in zip(seqs, cached, slots, strict=True):
        if c:  # prefill the cached prefix on its own first
            runner.forward(ForwardBatch.build([s[:c]], [sl[:c]]))
    batch = ForwardBatch.build(
        [s[c:] for s, c in zip(seqs, cached, strict=True)],
        slots,
        all_logits=[True, True, False, False, True, True],
    )
    out = runner.forward(batch)
    row = 0
    for s, c, want_all in zip(seqs, cached, [True, True, False, False, True, True], strict=True):
        ref = hf_logits(hf, s)
        expected = ref[c:] if want_all else ref[-1:]
        assert close(out[row : row + len(expected)], expected) < TOL
        row += len(expected)
    assert row == out.shape[0]


def test_sliding_window_is_exercised():
    """Mistral's window (24) is shorter than the sequences above, so the mask matters."""
    hf, runner, alloc = make("mistral")
    assert runner.arch.sliding_windows == (24, 24)
    ids = torch.randint(0, 512, (60,)).tolist()
    out = runner.forward(ForwardBatch.build([ids], [alloc.alloc(60)], all_logits=[True]))
    assert close(out, hf_logits(hf, ids)) < TOL
    full = tiny_hf_model("llama")  # the same model without a window differs past position 24
    full.load_state_dict(hf.state_dict())
    assert close(hf_logits(full, ids)[30:], out[30:]) > 1e-3


def test_unsupported_architecture_is_a_clear_error():
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        ModelArch.from_hf(config)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_paged_kernel_matches_reference_with_window_and_bf16(head_dim):
    """The native kernel vs gather + SDPA on ragged, scattered, windowed decodes and short
    extends (several query rows per sequence), fp32 and bf16, with each row's log-sum-exp.
    Single-row decodes take the vectorized paths (bf16 on vdpbf16ps at head_dim 64/128)."""
    import torch.nn.functional as F

    from runtime.model.native.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(0)
    kv_lens, q_lens = [1, 7, 64, 130, 40, 333, 17], [1, 3, 1, 17, 40, 1, 1]
    k_pool, v_pool = torch.randn(2, 1000, 2, head_dim, generator=gen)
    q = torch.randn(sum(q_lens), 6, head_dim, generator=gen)
    slots = torch.randperm(1000, generator=gen)[: sum(kv_lens)]
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()])
    qo_indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    for window in (0, 20):
        expected, expected_lse = [], []
        for b, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
            rows = slots[kv_indptr[b] : kv_indptr[b + 1]]
            q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
            k_pos = torch.arange(kv_len)[None, :]
            mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
            qb = q[qo_indptr[b] : qo_indptr[b + 1]]
            scores = torch.einsum("nhd,lhd->nhl", qb, k_pool[rows].repeat_interleave(3, 1))
            scores = scores * head_dim**-0.5
            expected_lse.append(torch.logsumexp(scores.masked_fill(~mask[:, None], -1e30), -1))
            expected.append(
                F.scaled_dot_product_attention(
                    qb.transpose(0, 1)[None],
                    k_pool[rows].transpose(0, 1)[None],
                    v_pool[rows].transpose(0, 1)[None],
                    attn_mask=mask,
                    enable_gqa=True,
                )[0].transpose(0, 1)
            )
        expected, expected_lse = torch.cat(expected), torch.cat(expected_lse)
        got, lse = kernels.paged_attention(
            q, k_pool, v_pool, slots, kv_indptr, qo_indptr, head_dim**-0.5, window, 0.0, 0
        )
        assert close(got, expected) < 1e-5
        assert close(lse, expected_lse) < 1e-5
        got16, lse16 = kernels.paged_attention(
            q.bfloat16(),
            k_pool.bfloat16(),
            v_pool.bfloat16(),
            slots,
            kv_indptr,
            qo_indptr,
            head_dim**-0.5,
            window,
            0.0,
            0,
        )
        assert close(got16.float(), expected) < 3e-2
        assert close(lse16, expected_lse) < 3e-2


def test_flashinfer_is_never_imported_on_cpu():
    import sys

    hf, runner, alloc = make("llama", "cpu")
    runner.forward(ForwardBatch.build([[1, 2, 3]], [alloc.alloc(3)]))
    assert "flashinfer" not in sys.modules


def test_unknown_backend_and_flashinfer_on_cpu():
    hf = tiny_hf_model("llama")
    arch = ModelArch.from_hf(hf.config)
    with pytest.raises(ValueError, match="unknown attention backend"):
        ModelRunner(arch, hf.state_dict(), 64, EngineConfig(attention_backend="triton"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(arch, hf.state_dict(), 64, EngineConfig(attention_backend="flashinfer"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_kernel_split_by_kv_head_changes_nothing(dtype):
    """A lone decode is split across threads by KV head; in a large batch it is one task. The
    two must agree bit for bit (each head's arithmetic is the same either way)."""
    from runtime.model.native.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    gen = torch.Generator().manual_seed(1)
    num_seqs, kv_len = 40, 300
    k_pool, v_pool = torch.randn(2, 20_000, 3, 64, generator=gen).to(dtype)
    q = torch.randn(num_seqs, 9, 64, generator=gen).to(dtype)
    slots = torch.randperm(20_000, generator=gen)[: num_seqs * kv_len]
    kv_indptr = torch.arange(0, num_seqs * kv_len + 1, kv_len)
    qo_indptr = torch.arange(num_seqs + 1)
    batch, batch_lse = kernels.paged_attention(
        q, k_pool, v_pool, slots, kv_indptr, qo_indptr, 0.125, 0, 0.0, 0
    )
    for b in (0, 17, 39):
        one, one_lse = kernels.paged_attention(
            q[b : b + 1].contiguous(),
            k_pool,
            v_pool,
            slots[b * kv_len : (b + 1) * kv_len],
            torch.tensor([0, kv_len]),
            torch.tensor([0, 1]),
            0.125,
            0,
            0.0,
            0,
        )
        assert torch.equal(one[0], batch[b])
        assert torch.equal(one_lse[0], batch_lse[b])
