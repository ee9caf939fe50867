"""Decodes attended chunk by chunk, so that a token never depends on its batch.

The vectorized decode attends a sequence's keys in chunks of KV_CHUNK positions and merges the
chunks' results in order. In a batch-invariant engine, decodes that share a cached prefix of
whole chunks attend it once (`prefix_attention`) and continue each row over its own keys
(`paged_decode_merge`): every row, a verified draft's rows too, must get bit for bit what its
sequence attended alone gets, in both dtypes, whatever else is in the batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import scattered_prefix, suffix_slots
from hypothesis import example, given, settings
from hypothesis import strategies as st

from runtime.cache.pool import KVPool
from runtime.model.attention.cpu_backend import CpuPagedAttention
from runtime.model.batch import ForwardBatch
from runtime.model.native.kernels import KV_CHUNK, load_cpu_kernels, native_flash_supported

pytestmark = pytest.mark.skipif(
    not native_flash_supported(), reason="this CPU lacks AVX-512 BF16 (the kernels are not built)"
)


def alone(kernels, q_row, pool_k, pool_v, keys, scale):
    """One query row decoded over `keys` as a batch of one sequence, in chunks as a
    batch-invariant engine does: (H, D) in q's dtype."""
    out, _ = kernels.paged_attention(
        q_row[None].contiguous(), pool_k, pool_v, keys, torch.tensor([0, keys.numel()]),
        torch.tensor([0, 1]), scale, 0, 0.0, KV_CHUNK,
    )  # fmt: skip
    return out[0]


def reference(q_row, keys_k, keys_v, scale):
    """float64 attention of one row (H, D) over (L, KVH, D) keys."""
    group = q_row.shape[0] // keys_k.shape[1]
    kf = keys_k.double().repeat_interleave(group, 1)
    vf = keys_v.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q_row.double(), kf) * scale
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), vf)


@settings(max_examples=40, deadline=None)
@given(
    rows_per_member=st.lists(st.integers(1, 16), min_size=1, max_size=20),
    prefix_chunks=st.integers(1, 5),
    group=st.sampled_from([1, 3, 4]),
    head_dim=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_a_shared_prefix_continues_as_each_sequence_alone(
    rows_per_member, prefix_chunks, group, head_dim, dtype, seed
):
    """Members of 1-16 rows each (the last rows of their own keys, causal among them) behind a
    prefix of whole chunks held in scattered slots: each row gets bit for bit the one-row decode
    of its sequence alone, is close to float64 attention, and no other row of out is written."""
    gen = torch.Generator().manual_seed(seed)
    prefix_len = prefix_chunks * KV_CHUNK
    pool_k, pool_v, prefix, free, heads = scattered_prefix(gen, group, head_dim, dtype, prefix_len)
    counts = torch.tensor(rows_per_member)
    lengths = counts + torch.randint(0, 200, counts.shape, generator=gen)
    suffixes = suffix_slots(free, lengths)
    num_rows = int(counts.sum())
    q = torch.randn(num_rows + 3, heads, head_dim, generator=gen).to(dtype)
    rows = torch.arange(2, 2 + num_rows)  # consecutive per member, after two other rows
    kernels = load_cpu_kernels()
    scale = head_dim**-0.5
    prefix_out, prefix_lse = kernels.prefix_attention(q, rows, pool_k, pool_v, prefix, scale)
    kv_indptr, qo_indptr = torch.zeros(2, counts.numel() + 1, dtype=torch.int64)
    kv_indptr[1:], qo_indptr[1:] = lengths.cumsum(0), counts.cumsum(0)
    out = torch.full_like(q, 7.0)
    kernels.paged_decode_merge(
        q, pool_k, pool_v, torch.cat(suffixes), kv_indptr, qo_indptr, rows, prefix_out,
        prefix_lse, scale, KV_CHUNK, out,
    )  # fmt: skip
    worst = 0.0
    for b, (n, suffix) in enumerate(zip(rows_per_member, suffixes, strict=True)):
        for r in range(n):
            row = int(rows[int(qo_indptr[b]) + r])
            keys = torch.cat([prefix, suffix[: suffix.numel() - n + r + 1]])
            single = alone(kernels, q[row], pool_k, pool_v, keys, scale)
            assert torch.equal(out[row], single), (b, r)
            want = reference(q[row], pool_k[keys], pool_v[keys], scale)
            worst = max(worst, (out[row].double() - want).abs().max().item())
    assert worst < (2e-2 if dtype == torch.bfloat16 else 1e-5)
    assert (out[:2] == 7.0).all() and (out[2 + num_rows :] == 7.0).all()


def test_the_fused_kernels_refuse_mismatched_inputs():
    kernels = load_cpu_kernels()
    q, q17 = torch.zeros(4, 6, 64), torch.zeros(17, 6, 64)
    pool = torch.zeros(200, 2, 64)
    prefix_out, prefix_lse = torch.zeros(2, 6, 64), torch.zeros(2, 6)
    two_seqs = dict(
        slots=torch.arange(5), kv_indptr=torch.tensor([0, 3, 5]), qo=torch.tensor([0, 1, 2])
    )
    one_seq = dict(slots=torch.arange(5), kv_indptr=torch.tensor([0, 5]), qo=torch.tensor([0, 2]))
    cases = [  # (what the error says, the inputs changed from a valid call)
        ("row 4 outside q's 4 rows", dict(two_seqs, rows=torch.tensor([0, 4]))),
        ("prefix_out \\(rows, H, D\\)", dict(two_seqs, prefix_out=prefix_out[:1])),
        ("share a dtype", dict(two_seqs, out=torch.empty_like(q).bfloat16())),
        ("prefix_out and prefix_lse are fp32", dict(two_seqs, prefix_out=prefix_out.bfloat16())),
        ("sequence 0's rows must be consecutive", dict(one_seq, rows=torch.tensor([0, 2]))),
        (
            "sequence 0 has 17 rows; 1 to 16 expected",
            dict(
                q=q17, out=torch.zeros_like(q17), slots=torch.arange(20),
                kv_indptr=torch.tensor([0, 20]), qo=torch.tensor([0, 17]), rows=torch.arange(17),
                prefix_out=torch.zeros(17, 6, 64), prefix_lse=torch.zeros(17, 6),
            ),
        ),
        (
            "rows are the last of its keys, but it has 1",
            dict(slots=torch.arange(1), kv_indptr=torch.tensor([0, 1]), qo=torch.tensor([0, 2])),
        ),
    ]  # fmt: skip
    for message, changed in cases:
        valid = dict(
            q=q, out=torch.empty_like(q), rows=torch.tensor([0, 1]), prefix_out=prefix_out,
            prefix_lse=prefix_lse,
        )  # fmt: skip
        call = valid | changed
        with pytest.raises(RuntimeError, match=message):
            kernels.paged_decode_merge(
                call["q"], pool, pool, call["slots"], call["kv_indptr"], call["qo"], call["rows"],
                call["prefix_out"], call["prefix_lse"], 0.1, KV_CHUNK, call["out"],
            )  # fmt: skip
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=f"100 keys; whole chunks of {KV_CHUNK} expected"):
        kernels.prefix_attention(q, rows, pool, pool, torch.arange(100), 0.1)
    with pytest.raises(RuntimeError, match="int64 rows and slots"):
        kernels.prefix_attention(q, rows.int(), pool, pool, torch.arange(64), 0.1)
    with pytest.raises(RuntimeError, match="head_dim 64 and 32 heads per KV head"):
        kernels.prefix_attention(torch.zeros(2, 64, 64), rows, pool, pool, torch.arange(64), 0.1)


@st.composite
def decode_batches(draw):
    """Decoding sequences (1-16 new rows each) grown from 1-3 trunks: (slot lists, new rows)."""
    trunks = [
        torch.arange(1000 * t, 1000 * t + draw(st.integers(1, 400)))
        for t in range(draw(st.integers(1, 3)))
    ]
    lists, new, next_slot = [], [], 5000
    for _ in range(draw(st.integers(1, 9))):
        trunk = trunks[draw(st.integers(0, len(trunks) - 1))]
        keep = draw(st.integers(1, trunk.numel()))
        num_new = draw(st.integers(1, 16))
        own = num_new + draw(st.integers(0, 90))
        lists.append(torch.cat([trunk[:keep], torch.arange(next_slot, next_slot + own)]))
        new.append(num_new)
        next_slot += own
    return lists, new


# three decodes behind 300 shared slots (cut to 256), one of them verifying a 5-token draft
W1_LIKE = (
    [torch.cat([torch.arange(300), torch.arange(5000 + 99 * i, 5040 + 99 * i)]) for i in range(3)],
    [1, 6, 1],
)


@settings(max_examples=40, deadline=None)
@example(batch=W1_LIKE, dtype=torch.bfloat16, seed=0)
@given(
    batch=decode_batches(),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_a_decode_computes_the_same_in_any_batch(batch, dtype, seed):
    """The CPU backend over a batch of decodes (cascades wherever 64 cached slots are shared):
    each sequence's rows are bit for bit those of the sequence planned and attended alone."""
    slot_lists, num_new = batch
    heads, kv_heads, head_dim, num_slots = 6, 2, 64, 8192
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(1, num_slots, kv_heads, head_dim, dtype)
    pool.k[0].copy_(torch.randn(num_slots, kv_heads, head_dim, generator=gen))
    pool.v[0].copy_(torch.randn(num_slots, kv_heads, head_dim, generator=gen))
    ids = [[1] * n for n in num_new]
    whole = ForwardBatch.build(ids, slot_lists)
    q = torch.randn(whole.num_tokens, heads, head_dim, generator=gen).to(dtype)
    k, v = torch.randn(2, whole.num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    backend = CpuPagedAttention(pool, (None,), batch_invariant=True)
    backend.plan(whole)
    together = backend.forward(0, q, k, v)
    start = 0
    for i, n in enumerate(num_new):
        rows = slice(start, start + n)
        single = CpuPagedAttention(pool, (None,), batch_invariant=True)
        single.plan(ForwardBatch.build([ids[i]], [slot_lists[i]]))
        assert single._cascades == []
        assert torch.equal(together[rows], single.forward(0, q[rows], k[rows], v[rows])), i
        start += n
    for cascade in backend._cascades:
        assert cascade.fused_decode and cascade.prefix.length % KV_CHUNK == 0
    if batch is W1_LIKE:
        assert [c.prefix.length for c in backend._cascades] == [256]


def test_bf16_greedy_tokens_do_not_depend_on_the_batch(head_dim_64_model_dir):
    """bf16, W1's first users behind one system prompt, two turns: each request's greedy tokens
    are the same served alone, served all together (decodes fused behind the shared prompt), and
    served together with speculation (drafts verified beside other requests' plain decodes)."""
    from programs import support_agent
    from runtime.config import EngineConfig
    from runtime.engine import Engine
    from runtime.protocol import GenerateRequest, SamplingParams

    sampling = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)

    def serve(speculative: str, alone: bool) -> list[list[int]]:
        config = EngineConfig(
            model=str(head_dim_64_model_dir), dtype="bfloat16", max_kv_tokens=30_000,
            speculative=speculative, batch_invariant=True,
        )  # fmt: skip
        with Engine(config) as engine:
            inputs = support_agent.make_inputs(engine.tokenizer, "test")
            prompts = support_agent.first_turn_ids(engine.tokenizer, inputs)[:6]

            def generate(batch):
                reqs = [GenerateRequest(input_ids=p, sampling=sampling) for p in batch]
                if alone:
                    return [engine.generate([r])[0].output_ids for r in reqs]
                return [r.output_ids for r in engine.generate(reqs)]

            first = generate(prompts)
            second = generate([p + o + p[-20:] for p, o in zip(prompts, first, strict=True)])
            if not alone:
                assert engine.runner.attention.fused_decode_passes > 0
            return first + second

    together = serve("off", alone=False)
    assert serve("off", alone=True) == together
    assert serve("tree", alone=False) == together
