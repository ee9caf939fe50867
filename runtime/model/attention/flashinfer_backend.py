"""flashinfer attention on CUDA: paged KV straight from the pool, planned once per batch.

Unverified until tests/test_gpu.py has run it against the torch reference on an H100/H200
(no GPU has been available yet). Imported only when the "flashinfer" backend is chosen on a
CUDA device.

The pool's per-layer K and V, (num_slots, kv_heads, head_dim), are exactly flashinfer's NHD
page layout (num_pages, page_size, kv_heads, head_dim) viewed with num_pages = num_slots /
page_size, so no KV is copied. Pure-decode batches use the decode kernels; anything with an
extend uses the prefill kernels (causal, bottom-right aligned, which is what an extend after
a cached prefix needs).
"""

from __future__ import annotations

import torch

from runtime.model.attention.base import AttentionBackend
from runtime.model.batch import ForwardBatch

WORKSPACE_BYTES = 256 << 20


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, pool, sliding_windows, num_heads: int, page_size: int) -> None:
        import flashinfer  # lazy: never imported on the CPU path

        super().__init__(pool, sliding_windows)
        self.page_size = page_size
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = pool.k[0].shape[1:]
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._windows = sorted({w for w in sliding_windows if w is not None})
        if len(self._windows) > 1:
            raise NotImplementedError("several different sliding windows in one model")

    def plan(self, batch: ForwardBatch) -> None:
        device, ps = self.pool.device, self.page_size
        pages, indptr, last_len = [], [0], []
        for slots in batch.kv_slots:
            seq_pages = slots[::ps] // ps  # the page of every page_size-th slot
            pages.append(seq_pages)
            indptr.append(indptr[-1] + seq_pages.numel())
            last_len.append(slots.numel() - (seq_pages.numel() - 1) * ps)
        kv_indices = torch.cat(pages).to(device=device, dtype=torch.int32)
        kv_indptr = torch.tensor(indptr, dtype=torch.int32, device=device)
        kv_last = torch.tensor(last_len, dtype=torch.int32, device=device)
        self._out_slots = batch.out_slots.to(device)
        self._is_decode = all(e == 1 for e in batch.extend_lens)
        window = (self._windows[0] - 1) if self._windows else -1
        common = dict(q_data_type=self.pool.dtype, kv_data_type=self.pool.dtype)
        if self._is_decode:
            self._decode.plan(
                kv_indptr,
                kv_indices,
                kv_last,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                window_left=window,
                **common,
            )
        else:
            qo = torch.tensor(
                [0, *torch.tensor(batch.extend_lens).cumsum(0).tolist()],
                dtype=torch.int32,
                device=device,
            )
            self._prefill.plan(
                qo,
                kv_indptr,
                kv_indices,
                kv_last,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                causal=True,
                window_left=window,
                **common,
            )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self._out_slots, k, v)
        ps = self.page_size
        # (num_pages, page_size, num_kv_heads, head_dim): the pool, viewed, not copied
        k_cache = self.pool.k[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        v_cache = self.pool.v[layer].view(-1, ps, self.num_kv_heads, self.head_dim)
        wrapper = self._decode if self._is_decode else self._prefill
        if self.sliding_windows[layer] is None and self._windows:
            raise NotImplementedError("mixed sliding and full layers with flashinfer")
        out = wrapper.run(q.contiguous(), (k_cache, v_cache))  # (num_tokens, heads, head_dim)
        return out.reshape(q.shape[0], -1)
