"""flashinfer attention on CUDA: paged KV straight from the pool, planned once per batch.

Imported only when the "flashinfer" backend is chosen on a CUDA device (flashinfer itself is
imported in the constructor, so `page_table` is importable and tested anywhere).

The pool's per-layer K and V, (num_slots, kv_heads, head_dim), are exactly flashinfer's NHD
page layout (num_pages, page_size, kv_heads, head_dim) viewed with num_pages = num_slots /
page_size, so no KV is copied. Pure-decode batches use the decode kernels; anything with an
extend uses the prefill kernels (causal, bottom-right aligned, which is what an extend after
a cached prefix needs). Decode graphs get one cudagraph-mode decode wrapper per captured batch
size, each with its page table in static buffers that `plan_graph_decode` rewrites before a
replay.
"""

from __future__ import annotations

import torch

from runtime.model.attention.base import AttentionBackend
from runtime.model.batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20
# fa2 for prefill: the fa3 kernels' JIT build takes minutes on first use, and prefill at
# these shapes is mostly GEMM time (gpu_bench.py measures it against the matmul rate)
PREFILL_KERNELS = "fa2"


def page_table(
    kv_slots: tuple[torch.Tensor, ...], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's paged-KV description of sequences given their slot lists, on the host:
    kv_indptr (num_seqs + 1,), kv_indices (total pages,) and last_page_len (num_seqs,), int32.

    A sequence's slots come in whole pages (the allocator's contract), so its pages are the
    page ids of every page_size-th slot and its last page holds the remainder.
    """
    lengths = torch.tensor([s.numel() for s in kv_slots], dtype=torch.int64)
    counts = (lengths + page_size - 1) // page_size
    indptr = torch.zeros(len(kv_slots) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(counts, 0)
    slots = torch.cat(kv_slots) if kv_slots else torch.zeros(0, dtype=torch.int64)
    if page_size == 1:
        indices = slots
    else:  # vectorized over the batch: each sequence's every page_size-th slot
        first_slot = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, counts)
        page_in_seq = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1], counts)
        indices = slots[first_slot + page_in_seq * page_size] // page_size
    last_page_len = lengths - (counts - 1) * page_size
    return indptr.to(torch.int32), indices.to(torch.int32), last_page_len.to(torch.int32)


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    supports_decode_graphs = True

    def __init__(self, pool, sliding_windows, num_heads: int, page_size: int, softcap=None) -> None:
        import flashinfer  # lazy: never imported on the CPU path

        super().__init__(pool, sliding_windows, softcap)
        self._flashinfer = flashinfer
        self.page_size = page_size
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = pool.k[0].shape[1:]
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        # grouped heads (4+ queries per KV head) decode faster on tensor cores, which run
        # flashinfer's prefill kernels (the module the extends already use), as SGLang does
        self._tensor_cores = num_heads // self.num_kv_heads >= 4
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._tensor_cores
        )
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=PREFILL_KERNELS
        )
        self._graph_decodes: dict[int, object] = {}  # captured batch size -> its wrapper
        windows = sorted({w for w in sliding_windows if w is not None})
        if len(windows) > 1 or (windows and None in sliding_windows):
            raise NotImplementedError("flashinfer backend: one sliding window for every layer")
        self._window_left = windows[0] - 1 if windows else -1
        # what every plan is told of the heads and pages
        self._shape = (num_heads, self.num_kv_heads, self.head_dim, page_size)

    def _plan_args(self) -> dict:
        return dict(
            window_left=self._window_left,
            logits_soft_cap=self.softcap,
            q_data_type=self.pool.dtype,
            kv_data_type=self.pool.dtype,
        )

    def plan(self, batch: ForwardBatch) -> None:
        indptr, indices, last_len = page_table(batch.kv_slots, self.page_size)
        self._out_slots = batch.out_slots.to(self.pool.device)
        if all(e == 1 for e in batch.extend_lens):
            self._wrapper = self._decode
            self._decode.plan(indptr, indices, last_len, *self._shape, **self._plan_args())
        else:
            qo_indptr = torch.zeros(batch.num_seqs + 1, dtype=torch.int32)
            qo_indptr[1:] = torch.cumsum(torch.tensor(batch.extend_lens), 0)
            self._wrapper = self._prefill
            self._prefill.plan(
                qo_indptr, indptr, indices, last_len, *self._shape, causal=True, **self._plan_args()
            )

    def prepare_decode_graphs(self, batch_sizes: tuple[int, ...], max_seq_len: int) -> None:
        device, ps = self.pool.device, self.page_size
        max_pages = max(batch_sizes) * -(-max_seq_len // ps)
        # shared by every size's wrapper: only one plans and runs at a time
        self._graph_indices = torch.zeros(max_pages, dtype=torch.int32, device=device)
        for size in batch_sizes:
            self._graph_decodes[size] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
            )

    def plan_graph_decode(self, batch: ForwardBatch, out_slots: torch.Tensor) -> None:
        indptr, indices, last_len = page_table(batch.kv_slots, self.page_size)
        wrapper = self._graph_decodes[batch.num_seqs]
        wrapper.plan(indptr, indices, last_len, *self._shape, **self._plan_args())
        self._wrapper = wrapper
        self._out_slots = out_slots

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self._out_slots, k, v)
        ps = self.page_size
        # (num_pages, page_size, num_kv_heads, head_dim): the pool, viewed, not copied
        k_cache = self.pool.k[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        v_cache = self.pool.v[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        out = self._wrapper.run(q.contiguous(), (k_cache, v_cache))  # (tokens, heads, head_dim)
        return out.reshape(q.shape[0], -1)
