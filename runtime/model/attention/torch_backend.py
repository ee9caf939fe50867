"""Reference attention: gather K/V rows from the pool by slot, then PyTorch SDPA with GQA.

Works on CPU and CUDA. Decodes are batched into one padded SDPA call per layer; each extend
is one call (a fresh prefill with no cached prefix attends to its own new K/V, no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from runtime.model.attention.base import AttentionBackend
from runtime.model.batch import ForwardBatch


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a batch: its token rows and its full slot list."""

    row_start: int
    num_new: int
    seq_len: int
    slots: torch.Tensor  # (seq_len,) cached prefix + new tokens

    @property
    def prefix_len(self) -> int:
        return self.seq_len - self.num_new


def sequences_of(batch: ForwardBatch) -> list[SeqSpan]:
    spans, row = [], 0
    for num_new, seq_len, slots in zip(
        batch.extend_lens, batch.seq_lens, batch.kv_slots, strict=True
    ):
        spans.append(SeqSpan(row, num_new, seq_len, slots))
        row += num_new
    return spans


@dataclass
class _Extend:
    row_start: int
    num_new: int
    prefix_len: int
    slots: torch.Tensor  # (prefix_len + num_new,)


@dataclass
class _PaddedDecodes:
    rows: torch.Tensor  # (num_decodes,) token rows
    slots: torch.Tensor  # (num_decodes, max_len) padded with slot 0 (masked out)
    flat_slots: torch.Tensor  # (num_decodes * max_len,)
    seq_lens: torch.Tensor  # (num_decodes,)
    ragged: bool  # lengths differ: padding must be masked


class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(self, pool, sliding_windows, softcap=None) -> None:
        super().__init__(pool, sliding_windows, softcap)
        # (2, capacity, num_kv_heads, head_dim): gathered K and V, reused by every layer
        self._workspace = torch.empty(
            (2, 0, *pool.k[0].shape[1:]), dtype=pool.dtype, device=pool.device
        )

    def plan(self, batch: ForwardBatch) -> None:
        self.out_slots = batch.out_slots.to(self.pool.device)
        self._num_tokens = batch.num_tokens
        self._mask_cache: dict[tuple[int, int | None], torch.Tensor | None] = {}
        self.plan_sequences(sequences_of(batch))

    def plan_sequences(self, seqs: list[SeqSpan]) -> None:
        """Attention plans for `seqs` (all of the batch, or the part a subclass leaves here)."""
        self._extends: list[_Extend] = []
        decode_rows, decode_slots, decode_lens = [], [], []
        for seq in seqs:
            if self._in_decode_group(seq.num_new, seq.seq_len):
                decode_rows.extend(range(seq.row_start, seq.row_start + seq.num_new))
                decode_slots.append(seq.slots)
                decode_lens.append(seq.num_new)
            else:
                slots = seq.slots.to(self.pool.device)
                self._extends.append(
                    _Extend(seq.row_start, seq.num_new, seq.seq_len - seq.num_new, slots)
                )
        self.decode_group = (
            self._plan_decodes(decode_rows, decode_slots, decode_lens) if decode_rows else None
        )
        # one kernel call answers every row: no scatter into a fresh output
        self.decodes_cover_all = not self._extends and len(decode_rows) == self._num_tokens

    def _in_decode_group(self, ext_len: int, seq_len: int) -> bool:
        """Sequences attended together by `_attend_decodes` (here: single-token decodes)."""
        return ext_len == 1 and seq_len > 1

    def _plan_decodes(
        self, rows: list[int], slots: list[torch.Tensor], extend_lens: list[int]
    ) -> _PaddedDecodes:
        device = self.pool.device
        seq_lens = torch.tensor([s.numel() for s in slots], device=device)
        padded = pad_sequence(slots, batch_first=True).to(device)
        return _PaddedDecodes(
            rows=torch.tensor(rows, device=device),
            slots=padded,
            flat_slots=padded.reshape(-1),
            seq_lens=seq_lens,
            ragged=bool((seq_lens != seq_lens[0]).any()),
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.out_slots, k, v)
        window = self.sliding_windows[layer]
        num_heads, head_dim = q.shape[1], q.shape[2]
        if self.decode_group is not None and self.decodes_cover_all:
            return self._attend_decodes(layer, q, window).reshape(-1, num_heads * head_dim)
        out = torch.empty_like(q)  # (num_tokens, num_heads, head_dim)
        self.attend_into(layer, q, k, v, window, out)
        return out.reshape(self._num_tokens, num_heads * head_dim)

    def attend_into(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        out: torch.Tensor,
    ) -> None:
        """Attention for the planned decode group and extends, written into their rows of out."""
        if self.decode_group is not None:
            out[self.decode_group.rows] = self._attend_decodes(
                layer, q[self.decode_group.rows], window
            )
        for i, ext in enumerate(self._extends):
            rows = slice(ext.row_start, ext.row_start + ext.num_new)
            if ext.prefix_len == 0:
                k_seq, v_seq = k[rows], v[rows]  # nothing cached: attend to the new rows directly
            else:
                k_seq, v_seq = self.gather_kv(layer, ext.slots)
            out[rows] = self._attend_extend(i, ext, q[rows], k_seq, v_seq, window)

    def _attend_extend(
        self,
        i: int,
        ext: _Extend,
        q: torch.Tensor,
        k_seq: torch.Tensor,
        v_seq: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """One extend's new rows q (num_new, heads, d) over its whole sequence's K/V (seq_len,
        kv_heads, d), causal by absolute position -> (num_new, heads, d)."""
        mask = self._extend_mask(i, ext, window)
        # attention() takes batches with heads first: this extend is a batch of one
        # (1, heads, num_new, d) over (1, kv_heads, seq_len, d)
        q, k_seq, v_seq = (t.transpose(0, 1).unsqueeze(0) for t in (q, k_seq, v_seq))
        out = attention(q, k_seq, v_seq, mask, mask is None, self.softcap)
        return out.squeeze(0).transpose(0, 1)

    def _attend_decodes(self, layer: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
        """q (num_decodes, num_heads, head_dim) -> same shape; one padded SDPA call."""
        group = self.decode_group
        # (num_decodes, max_len, num_kv_heads, head_dim)
        k, v = self.gather_kv(layer, group.flat_slots)
        k = k.view(*group.slots.shape, *k.shape[1:])
        v = v.view(*group.slots.shape, *v.shape[1:])
        mask = self._decode_mask(window)
        out = attention(
            q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask, False, self.softcap
        )  # (num_decodes, num_heads, 1, head_dim)
        return out.squeeze(2)

    def gather_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at `slots` -> two (len(slots), num_kv_heads, head_dim) views.

        They land in a persistent workspace: fresh multi-MB outputs every layer would be
        mmap-ed and page-faulted each time, which costs more than the copy itself. index_select
        is also several times faster than advanced indexing here.
        """
        n = slots.numel()
        if self._workspace.shape[1] < n:
            shape = (2, max(n, 2 * self._workspace.shape[1]), *self.pool.k[0].shape[1:])
            self._workspace = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
        k, v = self._workspace[0, :n], self._workspace[1, :n]
        torch.index_select(self.pool.k[layer], 0, slots, out=k)
        torch.index_select(self.pool.v[layer], 0, slots, out=v)
        return k, v

    def _decode_mask(self, window: int | None) -> torch.Tensor | None:
        key = (-1, window)
        if key not in self._mask_cache:
            group = self.decode_group
            max_len = group.slots.shape[1]
            k_pos = torch.arange(max_len, device=group.slots.device)[None, :]
            q_pos = (group.seq_lens - 1)[:, None]
            mask = None
            if group.ragged:
                mask = k_pos <= q_pos
            if window is not None and max_len > window:
                in_window = k_pos > q_pos - window
                mask = in_window if mask is None else mask & in_window
            # (num_decodes, 1, 1, max_len) broadcast over heads and the single query
            self._mask_cache[key] = None if mask is None else mask[:, None, None, :]
        return self._mask_cache[key]

    def _extend_mask(self, i: int, ext: _Extend, window: int | None) -> torch.Tensor | None:
        key = (i, window)
        if key not in self._mask_cache:
            seq_len = ext.prefix_len + ext.num_new
            needs_window = window is not None and seq_len > window
            mask = None
            if ext.prefix_len or needs_window:
                device = self.pool.device
                q_pos = torch.arange(ext.prefix_len, seq_len, device=device)[:, None]
                k_pos = torch.arange(seq_len, device=device)[None, :]
                mask = k_pos <= q_pos  # (num_new, seq_len), causal by absolute position
                if needs_window:
                    mask &= k_pos > q_pos - window
            self._mask_cache[key] = mask
        return self._mask_cache[key]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    softcap: float | None,
) -> torch.Tensor:
    """q (B, heads, n, d), k/v (B, kv_heads, L, d) -> (B, heads, n, d). `mask` (bool, True =
    attend) broadcasts to (B, heads, n, L); `causal` needs n == L. PyTorch's SDPA, or by hand
    when the scores are soft-capped (SDPA has no cap), with transformers' eager numerics."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
        )
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (B, heads, n, L)
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
