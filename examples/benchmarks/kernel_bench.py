"""The native CPU attention kernels against the torch paths they replace, at W1's shapes.

    python examples/benchmarks/kernel_bench.py [--repeats 5] [--dtypes float32 bfloat16] [--gemm]

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64), both torch threads:
- flash, shared prefix: n query rows over a 2,048-token prefix, no mask (cascade attention);
- flash, causal: a 1,024-token extend attending itself;
- paged decode: 64 sequences, one new token each over 2,048 cached tokens at scattered slots
  (native kernel in place vs gather + SDPA, the torch reference path).
Prints medians (ms) and GFLOP/s (4 * rows * keys * heads * head_dim; causal counts half).
With --gemm, the panel GEMM against oneDNN instead, on SmolLM2's four projections (576 -> 1728
qkv-sized, 576 -> 3072 gate_up, 1536 -> 576 down, 576 -> 576 o) at 16-256 rows: the rows a
verifying pass keeps on the panel GEMM (runtime/model/linear.py).
With --quant, the GGUF block-format GEMM (csrc/quant_gemm.cpp) instead, at 1, 4 and 16 rows of
x on SmolLM2's shapes (576 -> 576 q/o, 576 -> 192 k/v, 576 -> 1536 gate/up, 576 -> 3072 fused,
1536 -> 576 down): the panel GEMM over the dequantized weight in x's dtype against Q8_0 and
Q4_1, each with x as given (a) and x quantized to int8 (b). Each variant cycles through copies
of its weight totalling 64 MB (twice the L3), so weights stream from memory as in a decode;
variants interleave, medians per call in µs and the weight bytes read per second.
With --backend, the CPU backend's whole attention of one layer (planning excluded) instead: B
decodes, or B extends of 80 tokens, behind a shared 2,000-token prefix, each with an own cached
tail (a prefix shared by every sequence of the batch: W1's system prompt), by default or
batch-invariant (--batch-invariant). Run it in two worktrees (PYTHONPATH=the worktree) to
compare versions of cpu_backend.py and its kernels.
With --draft-rows, one sequence's verifying pass instead: n new rows (a draft of n - 1 tokens
and the real one, causal among them) over 500 and 2,000 scattered keys, the paged decode kernel
as a batch-1 verification calls it, and the time each row beyond the first adds.
With --extends, a batch-invariant forward's GEMMs over several extends (runtime/model/linear.py,
`routed_rows`) on SmolLM2's four projections against the same calls unrouted (one GEMM for all
the rows: the panel up to PANEL_MAX_ROWS, else oneDNN). Routed, the extends' rows take oneDNN,
in bf16 one GEMM per extend.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from runtime.cache.pool import KVPool
from runtime.model.attention.cascade import causal_attention_with_lse, flash_attention_with_lse
from runtime.model.attention.cpu_backend import CpuPagedAttention
from runtime.model.batch import ForwardBatch
from runtime.model.linear import Linear, routed_rows
from runtime.model.native.kernels import GGML_Q4_1, GGML_Q8_0, load_cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def flash_rows(kernels, dtype: torch.dtype, repeats: int) -> list[tuple]:
    rows = []
    scale = HEAD_DIM**-0.5
    for label, n, keys, causal in (
        ("flash, 256 rows over a 2,048-token prefix", 256, 2048, False),
        ("flash, 1,024 rows over a 2,048-token prefix", 1024, 2048, False),
        ("flash, causal 1,024-token extend", 1024, 1024, True),
    ):
        q = torch.randn(n, HEADS, HEAD_DIM).to(dtype)  # (rows, heads, d)
        k = torch.randn(keys, KV_HEADS, HEAD_DIM).to(dtype)  # (keys, kv_heads, d)
        v = torch.randn(keys, KV_HEADS, HEAD_DIM).to(dtype)
        reference = causal_attention_with_lse if causal else flash_attention_with_lse
        torch_ms = median_ms(lambda: reference(q, k, v, scale), repeats)  # noqa: B023
        native_ms = median_ms(
            lambda: kernels.flash_attention(q, k, v, scale, causal),  # noqa: B023
            repeats,
        )
        flops = 4 * n * keys * HEADS * HEAD_DIM / (2 if causal else 1)
        rows.append((label, torch_ms, native_ms, flops))
    return rows


def decode_row(kernels, dtype: torch.dtype, repeats: int) -> tuple:
    num_seqs, context, num_slots = 64, 2048, 160_000
    pool_k = torch.randn(num_slots, KV_HEADS, HEAD_DIM).to(dtype)  # (slots, kv_heads, d)
    pool_v = torch.randn(num_slots, KV_HEADS, HEAD_DIM).to(dtype)
    slots = torch.randperm(num_slots)[: num_seqs * context]  # scattered, as after evictions
    indptr = torch.arange(0, num_seqs * context + 1, context)
    qo_indptr = torch.arange(num_seqs + 1)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5

    def native():
        kernels.paged_attention(q, pool_k, pool_v, slots, indptr, qo_indptr, scale, 0, 0.0, 0)

    def reference():  # gather each sequence's K/V, then SDPA with grouped heads
        k = pool_k[slots].view(num_seqs, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = pool_v[slots].view(num_seqs, context, KV_HEADS, HEAD_DIM).transpose(1, 2)
        F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    flops = 4 * num_seqs * context * HEADS * HEAD_DIM
    label = "paged decode, 64 seqs x 2,048 scattered keys"
    return label, median_ms(reference, repeats), median_ms(native, repeats), flops


GEMM_SHAPES = ((576, 1728), (576, 3072), (1536, 576), (576, 576))  # (in, out)


def gemm_table(kernels, dtype: torch.dtype, repeats: int) -> None:
    """Both GEMMs over the four projections in turn, medians interleaved per row count."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for k, n in GEMM_SHAPES]
    packed = [
        (kernels.panel_pack(w), torch.ops.mkldnn._reorder_linear_weight(w, 8), w.shape[0])
        for w in weights
    ]
    for rows in (16, 32, 48, 64, 96, 128, 192, 256):
        xs = [torch.randn(rows, k, generator=gen).to(dtype) for k, _ in GEMM_SHAPES]

        def panel(xs=xs):
            for x, (panels, _, n) in zip(xs, packed, strict=True):
                kernels.panel_gemm(x, panels, None, n)

        def onednn(xs=xs):
            for x, (_, w, _) in zip(xs, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        panel_ms, onednn_ms = median_ms(panel, repeats), median_ms(onednn, repeats)
        print(
            f"| {rows} | {str(dtype).removeprefix('torch.')} | {onednn_ms:.2f} | {panel_ms:.2f} "
            f"| {panel_ms / onednn_ms:.2f}x |"
        )


EXTENDS = ((17, 17), (20,) * 16, (32,) * 8, (64,) * 4, (256,) * 2, (512,) * 2)


def extends_table(dtype: torch.dtype, repeats: int) -> None:
    """Routed (batch-invariant) against unrouted Linear calls, interleaved per extend mix."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for k, n in GEMM_SHAPES]
    linears = [Linear(w, None, pack=True) for w in weights]
    for lens in EXTENDS:
        xs = [torch.randn(sum(lens), k, generator=gen).to(dtype) for k, _ in GEMM_SHAPES]

        def unrouted(xs=xs):
            for x, linear in zip(xs, linears, strict=True):
                linear(x)

        def routed(xs=xs, lens=lens):
            with routed_rows(lens):
                unrouted(xs)

        times = {unrouted: [], routed: []}
        for _ in range(repeats):
            for fn, ms in times.items():
                ms.append(median_ms(fn, 1))
        plain_ms, routed_ms = (statistics.median(ms) for ms in times.values())
        print(
            f"| {str(dtype).removeprefix('torch.')} | {len(lens)} x {lens[0]} | {plain_ms:.2f} "
            f"| {routed_ms:.2f} | {routed_ms / plain_ms:.2f}x |"
        )


QUANT_SHAPES = ((576, 576), (576, 192), (576, 1536), (576, 3072), (1536, 576))  # (in, out)
QUANT_TYPES = ((GGML_Q8_0, GGMLQuantizationType.Q8_0), (GGML_Q4_1, GGMLQuantizationType.Q4_1))
STREAM_BYTES = 64 << 20  # each variant's copies of its weight: twice the L3


def copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """Enough copies of a packed weight that a pass over them reads it from memory."""
    nbytes = weight.numel() * weight.element_size()
    return [weight.clone() for _ in range(math.ceil(STREAM_BYTES / nbytes))]


def quant_variants(kernels, k: int, n: int, dtype: torch.dtype) -> dict[str, tuple]:
    """name -> (a call over one copy, the copies, the bytes a call reads)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)).numpy() * 0.05
    variants = {}
    for code, gguf_type in QUANT_TYPES:
        raw = quantize(w, gguf_type)
        if code == GGML_Q8_0:  # the panel GEMM runs the dequantized Q8_0 weight
            plain = torch.from_numpy(dequantize(raw, gguf_type)).to(dtype)
            panels = copies(kernels.panel_pack(plain))
            variants["panel"] = (lambda x, p: kernels.panel_gemm(x, p, None, n), panels)
        packed = copies(kernels.quant_pack(torch.from_numpy(raw).reshape(-1), code, n, k))
        for path, int8 in (("a", False), ("b", True)):
            variants[f"{gguf_type.name} ({path})"] = (
                lambda x, p, c=code, q=int8: kernels.quant_gemm(x, p, c, None, n, q),
                packed,
            )
    return {
        name: (fn, ws, ws[0].numel() * ws[0].element_size()) for name, (fn, ws) in variants.items()
    }


def quant_table(kernels, dtype: torch.dtype, repeats: int) -> None:
    """Per shape and row count, every variant's median µs a call, interleaved."""
    for k, n in QUANT_SHAPES:
        variants = quant_variants(kernels, k, n, dtype)
        for rows in (1, 4, 16):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
            times = {name: [] for name in variants}
            for _ in range(repeats + 1):  # the first round warms up
                for name, (fn, weights, _) in variants.items():
                    start = time.perf_counter()
                    for weight in weights:
                        fn(x, weight)
                    times[name].append((time.perf_counter() - start) / len(weights) * 1e6)
            cells = []
            for name, (_, _, nbytes) in variants.items():
                us = statistics.median(times[name][1:])
                cells.append(f"{us:.1f} ({nbytes / us / 1e3:.0f})")
            label = str(dtype).removeprefix("torch.")
            print(f"| {label} | {k} -> {n} | {rows} | " + " | ".join(cells) + " |")


def draft_rows_table(kernels, dtype: torch.dtype, repeats: int) -> None:
    """paged_attention of one sequence's 1-16 new rows over its paged keys."""
    gen = torch.Generator().manual_seed(0)
    num_slots = 20_000
    pool_k, pool_v = torch.randn(2, num_slots, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    for keys in (500, 2000):
        slots = torch.randperm(num_slots, generator=gen)[:keys]  # scattered
        times = {}
        for rows in (1, 2, 3, 5, 9, 16):
            q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)  # (rows, heads, d)
            kv_indptr, qo_indptr = torch.tensor([0, keys]), torch.tensor([0, rows])
            times[rows] = median_ms(
                lambda q=q, s=slots, kv=kv_indptr, qo=qo_indptr: kernels.paged_attention(
                    q, pool_k, pool_v, s, kv, qo, HEAD_DIM**-0.5, 0, 0.0, 0
                ),
                repeats,
            )
        cells = " | ".join(f"{times[n] * 1e3:.0f}" for n in times)
        per_row = (times[16] - times[1]) / 15 * 1e3
        print(f"| {str(dtype).removeprefix('torch.')} | {keys:,} | {cells} | {per_row:.0f} |")


def backend_table(dtype: torch.dtype, repeats: int, batch_invariant: bool) -> None:
    """CpuPagedAttention.forward of one layer over decodes or extends behind a shared prefix."""
    gen = torch.Generator().manual_seed(0)
    prefix = 2000
    for kind, new, own in (("decodes", 1, 200), ("extends", 80, 100)):
        for batch in (1, 8, 32, 64) if kind == "decodes" else (1, 4, 8):
            per = own + new
            num_slots = prefix + batch * per
            pool = KVPool(1, num_slots, KV_HEADS, HEAD_DIM, dtype)
            pool.k[0].copy_(torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen))
            pool.v[0].copy_(torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen))
            slots = [
                torch.cat(
                    [torch.arange(prefix), torch.arange(prefix + i * per, prefix + (i + 1) * per)]
                )
                for i in range(batch)
            ]
            forward = ForwardBatch.build([[1] * new] * batch, slots)
            q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=gen).to(dtype)
            k, v = torch.randn(2, batch * new, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
            backend = CpuPagedAttention(pool, (None,), batch_invariant=batch_invariant)
            backend.plan(forward)
            ms = median_ms(lambda: backend.forward(0, q, k, v), repeats)  # noqa: B023
            print(
                f"| {kind} | {str(dtype).removeprefix('torch.')} | {batch} | {new} | "
                f"{ms:.3f} | {len(backend._cascades)} |"
            )


DRAFT_ROWS_HEADER = "| dtype | keys | 1 row µs | 2 | 3 | 5 | 9 | 16 | µs per extra row |"
BACKEND_HEADER = "| batch of | dtype | sequences | new tokens each | ms per layer | cascades |"
EXTENDS_HEADER = "| dtype | extends | unrouted ms | routed ms | routed / unrouted |"
GEMM_HEADER = "| rows | dtype | oneDNN ms | panel ms | panel / oneDNN |"
QUANT_HEADER = (
    "| dtype | in -> out | rows | panel µs (GB/s) | Q8_0 (a) | Q8_0 (b) | Q4_1 (a) | Q4_1 (b) |"
)
TEXT = ("dtype", "batch of", "in -> out", "extends")  # left-aligned columns; the rest are numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--gemm", action="store_true", help="panel GEMM vs oneDNN instead")
    parser.add_argument("--backend", action="store_true", help="the CPU backend's attention")
    parser.add_argument("--quant", action="store_true", help="GGUF Q8_0 / Q4_1 GEMM instead")
    parser.add_argument("--batch-invariant", action="store_true", help="with --backend")
    parser.add_argument("--draft-rows", action="store_true", help="a verifying pass's rows")
    parser.add_argument("--extends", action="store_true", help="batch-invariant extend GEMMs")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    print(f"torch threads: {torch.get_num_threads()}, medians of {args.repeats}\n")
    tables = (  # (chosen, header, one dtype's rows)
        (args.draft_rows, DRAFT_ROWS_HEADER, lambda d: draft_rows_table(kernels, d, args.repeats)),
        (
            args.backend,
            BACKEND_HEADER,
            lambda d: backend_table(d, args.repeats, args.batch_invariant),
        ),
        (args.gemm, GEMM_HEADER, lambda d: gemm_table(kernels, d, args.repeats)),
        (args.extends, EXTENDS_HEADER, lambda d: extends_table(d, args.repeats)),
        (args.quant, QUANT_HEADER, lambda d: quant_table(kernels, d, args.repeats)),
    )
    for chosen, header, table in tables:
        if chosen:
            columns = header.strip("| ").split(" | ")
            print(header)
            print("| " + " | ".join("---" if c in TEXT else "---:" for c in columns) + " |")
            for name in args.dtypes:
                table(getattr(torch, name))
            return
    print("| kernel | dtype | torch ms | native ms | torch GFLOP/s | native GFLOP/s | speed-up |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rows = flash_rows(kernels, dtype, args.repeats) + [decode_row(kernels, dtype, args.repeats)]
        for label, torch_ms, native_ms, flops in rows:
            print(
                f"| {label} | {name} | {torch_ms:.1f} | {native_ms:.1f} | "
                f"{flops / torch_ms / 1e6:.0f} | {flops / native_ms / 1e6:.0f} | "
                f"{torch_ms / native_ms:.2f}x |"
            )


if __name__ == "__main__":
    main()
