"""The CPU backend: the torch reference with a native paged kernel and cascade attention.

Decode attention is memory-bound; the reference path copies every sequence's K/V out of the
pool (index_select) and reads it again in SDPA. The native kernel reads each row once, in place,
with prefetch for scattered slots, and handles a few new tokens per sequence too (jump-forward,
scoring tails, verified drafts). Sequences that share a long cached prefix are attended as a
cascade (runtime/model/attention/cascade.py): the prefix once for all of them in one flash call,
each suffix alone. A prefix several sequences share is packed for the flash kernel once and kept
across steps (packed_prefixes.py); when every member is a decode (one row, or a verified
draft's few), the prefix and the suffixes run as two native calls that read q's rows and write
out's rows in place (no gathers, scatters or separate merge). Long extends with no shared
prefix stay with SDPA.

Batch-invariant (`batch_invariant=True`): a token is computed the same way whatever shares its
batch. The native decode attends a sequence's keys in chunks of KV_CHUNK positions; decodes
group only with decodes, behind a prefix cut to whole chunks, which it attends once for all
their rows and continues per row over its own keys, operation for operation as the sequence
attended alone; extends take the flash kernel one by one. The flash cascade is 2-3x faster on
the shared prefix at 8-64 decodes in bf16, so it is the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.cache.pool import KVPool
from runtime.model.attention.cascade import (
    SharedPrefix,
    causal_attention_with_lse,
    causal_suffix_mask,
    find_shared_prefixes,
    flash_attention_with_lse,
    in_whole_chunks,
    prefix_of_one,
)
from runtime.model.attention.packed_prefixes import PackedPrefix, PackedPrefixes
from runtime.model.attention.torch_backend import SeqSpan, TorchAttention
from runtime.model.native.kernels import KV_CHUNK, MAX_DECODE_ROWS

# packed shared prefixes kept across steps; W1's two (2k and 512 tokens) take ~60 MB in bf16
PACKED_PREFIX_BYTES = 256 << 20


@dataclass
class PagedDecodes:
    """Sequences with few new tokens, for one native kernel call."""

    rows: torch.Tensor  # (num_rows,) token rows
    slots: torch.Tensor  # (sum of key counts,) every sequence's key slots, concatenated
    indptr: torch.Tensor  # (num_seqs + 1,) offsets into slots
    qo_indptr: torch.Tensor  # (num_seqs + 1,) offsets into the group's query rows


def paged_decodes(rows: list[int], slots: list[torch.Tensor], num_new: list[int]) -> PagedDecodes:
    kv_indptr = torch.zeros(len(slots) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor([s.numel() for s in slots]), 0, out=kv_indptr[1:])
    qo_indptr = torch.zeros(len(slots) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(num_new), 0, out=qo_indptr[1:])
    return PagedDecodes(torch.tensor(rows), torch.cat(slots), kv_indptr, qo_indptr)


@dataclass(frozen=True)
class FusedDecodeStep:
    """A forward whose every row is a paged decode with nothing else to attend (no cascade,
    window or soft-cap): what csrc/decode_layers.cpp needs to attend it layer by layer."""

    pool: KVPool
    out_slots: torch.Tensor  # (num_tokens,) where each row's new K/V goes
    decodes: PagedDecodes
    kv_chunk: int  # paged_attention's kv_chunk: 0, or KV_CHUNK when batch-invariant


@dataclass
class _LongSuffix:
    """A member with many new tokens: its suffix attended by flash with a causal mask."""

    local_rows: slice  # its rows within the cascade's rows
    slots: torch.Tensor  # (suffix_len,)
    mask: torch.Tensor | None  # (num_new, suffix_len) additive; None: all new, plain causal


@dataclass
class _Cascade:
    prefix: SharedPrefix
    rows: torch.Tensor  # (num_rows,) token rows of every member
    short: PagedDecodes | None  # members with few new tokens; rows local to `rows`
    long: list[_LongSuffix]
    packed: PackedPrefix | None  # the prefix packed for flash, kept across steps
    # every member a decode of at most MAX_DECODE_ROWS rows: the prefix (by flash from `packed`,
    # or batch-invariant by the native decode over whole chunks) and each suffix run as two
    # native calls that read q's rows and write out's rows in place
    fused_decode: bool


class CpuPagedAttention(TorchAttention):
    name = "cpu"
    max_kernel_extend = 32
    min_shared_tokens = 64  # below this a shared prefix is cheaper attended per sequence

    def __init__(self, pool, sliding_windows, softcap=None, batch_invariant=False) -> None:
        super().__init__(pool, sliding_windows, softcap)
        from runtime.model.native.kernels import load_cpu_kernels, native_flash_supported

        self._kernels = load_cpu_kernels()
        # windowed layers would need the window applied across the cascade's two halves, and
        # the flash kernel that attends the shared prefix has no soft-capping
        self._cascade_enabled = all(w is None for w in sliding_windows) and softcap is None
        self._prefix_workspace = torch.empty((2, 0, *pool.k[0].shape[1:]), dtype=pool.dtype)
        # on AVX-512 BF16 the native flash kernel: 2.1-2.5x torch's in bf16 (which widens to
        # fp32), 1.2-1.4x in fp32; it takes causal masks itself, so none are planned for it
        head_dim = pool.k[0].shape[-1]
        self._native_flash = (
            pool.dtype in (torch.bfloat16, torch.float32)
            and head_dim in (64, 128)
            and native_flash_supported()
        )
        self.batch_invariant = batch_invariant and self._native_flash
        self._kv_chunk = KV_CHUNK if self.batch_invariant else 0  # 0: a sequence's keys at once
        if self.batch_invariant and self._cascade_enabled:
            # an extend takes the chunked decode (a draft's rows at most) or the flash kernel:
            # two ways of computing a row, not three
            self.max_kernel_extend = MAX_DECODE_ROWS
        self.cascade_passes = 0  # forward passes that attended a shared prefix once
        self.fused_decode_passes = 0  # ... of which decodes behind a packed prefix, fused
        self.packed_prefixes = (
            PackedPrefixes(pool, self._kernels, PACKED_PREFIX_BYTES) if self._native_flash else None
        )

    def plan_sequences(self, seqs: list[SeqSpan]) -> None:
        """Cascades for the sequences that share a long cached prefix; the rest as before."""
        shared = []
        if self._cascade_enabled and self.batch_invariant:
            # decodes only, behind whole chunks: extends take the flash kernel one by one
            lens = [s.prefix_len if s.num_new <= MAX_DECODE_ROWS else 0 for s in seqs]
            groups = find_shared_prefixes([s.slots for s in seqs], lens, self.min_shared_tokens)
            shared = [in_whole_chunks(g, KV_CHUNK) for g in groups]
            shared = [g for g in shared if g.length >= self.min_shared_tokens]
        elif self._cascade_enabled:
            prefix_lens = [s.prefix_len for s in seqs]
            slots = [s.slots for s in seqs]
            shared = find_shared_prefixes(slots, prefix_lens, self.min_shared_tokens)
            grouped = {i for group in shared for i in group.members}
            # a long extend after a long cached prefix is a cascade of one: the prefix needs
            # no mask (folded flash), the new tokens plain causal attention
            shared += [
                prefix_of_one(i, seq.slots[: seq.prefix_len])
                for i, seq in enumerate(seqs)
                if i not in grouped
                and seq.num_new > self.max_kernel_extend
                and seq.prefix_len >= self.min_shared_tokens
            ]
        in_cascade = {i for group in shared for i in group.members}
        if self.packed_prefixes is not None:
            self.packed_prefixes.begin_step()
        self._cascades = [self._plan_cascade(group, seqs) for group in shared]
        self.cascade_passes += bool(self._cascades)
        self.fused_decode_passes += any(c.fused_decode for c in self._cascades)
        super().plan_sequences([s for i, s in enumerate(seqs) if i not in in_cascade])

    def _in_decode_group(self, ext_len: int, seq_len: int) -> bool:
        return ext_len <= self.max_kernel_extend

    def fused_decode_step(self) -> FusedDecodeStep | None:
        plain = all(w is None for w in self.sliding_windows) and self.softcap is None
        if not plain or self._cascades or not self.decodes_cover_all:
            return None
        return FusedDecodeStep(self.pool, self.out_slots, self.decode_group, self._kv_chunk)

    def _plan_decodes(self, rows: list[int], slots: list[torch.Tensor], extend_lens: list[int]):
        return paged_decodes(rows, slots, extend_lens)

    def _attend_decodes(self, layer: int, q: torch.Tensor, window: int | None) -> torch.Tensor:
        return self._paged(layer, q, self.decode_group, window)[0]

    def _paged(
        self, layer: int, q: torch.Tensor, decodes: PagedDecodes, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The native kernel over `decodes`' key slots: out (rows, heads, d), lse (rows, heads)."""
        return self._kernels.paged_attention(
            q.contiguous(),
            self.pool.k[layer],
            self.pool.v[layer],
            decodes.slots,
            decodes.indptr,
            decodes.qo_indptr,
            q.shape[-1] ** -0.5,
            window or 0,
            self.softcap or 0.0,
            self._kv_chunk,
        )

    def _plan_cascade(self, prefix: SharedPrefix, seqs: list[SeqSpan]) -> _Cascade:
        rows, short_rows, short_slots, short_new, long = [], [], [], [], []
        for i in prefix.members:
            seq = seqs[i]
            local = len(rows)
            rows.extend(range(seq.row_start, seq.row_start + seq.num_new))
            suffix = seq.slots[prefix.length :]
            if seq.num_new <= self.max_kernel_extend:
                short_rows.extend(range(local, local + seq.num_new))
                short_slots.append(suffix)
                short_new.append(seq.num_new)
            else:
                mask = None
                if suffix.numel() > seq.num_new and not self._native_flash:
                    # an own cached tail before the new tokens: torch's flash needs a mask
                    mask = causal_suffix_mask(seq.num_new, suffix.numel(), self.pool.dtype)
                long.append(_LongSuffix(slice(local, local + seq.num_new), suffix, mask))
        short = paged_decodes(short_rows, short_slots, short_new) if short_rows else None
        # a prefix shared by several sequences is met again next step; one sequence's own
        # prefix grows by its chunk each step, so it is packed per call instead
        decodes = not long and all(seqs[i].num_new <= MAX_DECODE_ROWS for i in prefix.members)
        if self.batch_invariant:  # planned so: decodes behind whole chunks
            return _Cascade(prefix, torch.tensor(rows), short, long, None, decodes)
        packed = None
        if self.packed_prefixes is not None and len(prefix.members) > 1:
            packed = self.packed_prefixes.get(prefix.slots)
        fused = decodes and packed is not None
        return _Cascade(prefix, torch.tensor(rows), short, long, packed, fused)

    def attend_into(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        out: torch.Tensor,
    ) -> None:
        super().attend_into(layer, q, k, v, window, out)
        q = q.contiguous()
        # the vectorized decode takes up to 16 query heads per KV head
        fusable = q.shape[1] // self.pool.k[0].shape[1] <= 16
        for cascade in self._cascades:  # none for windowed models
            if cascade.fused_decode and fusable:
                self._attend_decodes_fused(layer, cascade, q, out)
            else:
                out[cascade.rows] = self._attend_cascade(layer, cascade, q, k, v)

    def _attend_extend(self, i, ext, q, k_seq, v_seq, window) -> torch.Tensor:
        """The native flash kernel aligns causality to the last keys itself: an extend after a
        cached prefix needs no (num_new, seq_len) mask, which sends torch's SDPA down its
        slower masked path (1.7x for 1,024 new tokens after 39 cached; 8x after 3,000)."""
        if not self._native_flash or window is not None or self.softcap is not None:
            return super()._attend_extend(i, ext, q, k_seq, v_seq, window)
        if k_seq.stride(0) != v_seq.stride(0):  # new rows: k is RoPE's output, v a view of qkv
            k_seq, v_seq = k_seq.contiguous(), v_seq.contiguous()
        scale = q.shape[-1] ** -0.5
        return self._kernels.flash_attention(q.contiguous(), k_seq, v_seq, scale, True)[0]

    def _attend_decodes_fused(
        self, layer: int, cascade: _Cascade, q: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Decodes (one row or a draft's few each) behind a shared prefix: q (num_tokens, heads,
        d) -> their rows of out, each row's prefix result continued over its own keys inside the
        paged kernel, in fp32, and rounded once."""
        scale = q.shape[-1] ** -0.5
        if cascade.packed is None:  # batch-invariant: the native decode over whole chunks
            out_prefix, lse_prefix = self._kernels.prefix_attention(
                q, cascade.rows, self.pool.k[layer], self.pool.v[layer], cascade.prefix.slots, scale
            )
        else:
            out_prefix, lse_prefix = self._packed_prefix_attention(layer, cascade, q, scale)
            out_prefix = out_prefix.float()
        short = cascade.short
        self._kernels.paged_decode_merge(
            q,
            self.pool.k[layer],
            self.pool.v[layer],
            short.slots,
            short.indptr,
            short.qo_indptr,
            cascade.rows,
            out_prefix,
            lse_prefix,
            scale,
            self._kv_chunk,
            out,
        )

    def _packed_prefix_attention(
        self, layer: int, cascade: _Cascade, q_all: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The members' rows of q_all over the kept packed prefix: out (num_rows, heads, d),
        lse (num_rows, heads)."""
        k_packed, v_packed = self.packed_prefixes.packed(cascade.packed, layer)
        return self._kernels.flash_attention_packed(
            q_all, cascade.rows, k_packed, v_packed, cascade.packed.length, scale, False
        )

    def _attend_cascade(
        self, layer: int, cascade: _Cascade, q_all: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q_all (num_tokens, heads, d) -> the members' rows' attention, (num_rows, heads, d).
        k/v (num_tokens, kv_heads, d): the batch's new K/V rows."""
        q = q_all[cascade.rows]
        scale = q.shape[-1] ** -0.5
        if cascade.packed is not None:
            out_prefix, lse_prefix = self._packed_prefix_attention(layer, cascade, q_all, scale)
        else:
            k_prefix, v_prefix = self._prefix_kv(layer, cascade.prefix)
            out_prefix, lse_prefix = self._flash(q, k_prefix, v_prefix, scale, causal=False)
        out_suffix = torch.empty_like(q)
        lse_suffix = torch.empty(q.shape[:2], dtype=torch.float32)
        if cascade.short is not None:
            rows = cascade.short.rows
            out_suffix[rows], lse_suffix[rows] = self._paged(layer, q[rows], cascade.short, None)
        for part in cascade.long:
            rows = part.local_rows
            if part.slots.numel() == part.local_rows.stop - part.local_rows.start:
                k_own, v_own = k[cascade.rows[rows]], v[cascade.rows[rows]]  # all new
            else:
                k_own, v_own = self.gather_kv(layer, part.slots)
            out_suffix[rows], lse_suffix[rows] = self._flash(
                q[rows], k_own, v_own, scale, causal=True, mask=part.mask
            )
        return self._merge(out_prefix, lse_prefix, out_suffix, lse_suffix)

    def _merge(self, out_a, lse_a, out_b, lse_b) -> torch.Tensor:
        """The two halves' attention merged by log-sum-exp, natively (one pass; the torch
        reference is `cascade.merge_partial`)."""
        return self._kernels.merge_attention(
            out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(), lse_b.contiguous()
        )

    def _flash(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        causal: bool,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (n, heads, d) over k/v (L, kv_heads, d) -> out (n, heads, d), lse (n, heads).
        Causal: the n query rows are the last n of the L keys. Torch's kernels need `mask`
        (planned) when L > n; the native one does not."""
        if self._native_flash:
            return self._kernels.flash_attention(q.contiguous(), k, v, scale, causal)
        if causal and mask is None:
            return causal_attention_with_lse(q, k, v, scale)
        return flash_attention_with_lse(q, k, v, scale, mask)

    def _prefix_kv(self, layer: int, prefix: SharedPrefix) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix's K and V, (length, kv_heads, d): a view of the pool when its
        slots are one run, else gathered into a workspace kept across layers and steps."""
        if prefix.first_slot is not None:
            run = slice(prefix.first_slot, prefix.first_slot + prefix.length)
            return self.pool.k[layer][run], self.pool.v[layer][run]
        n = prefix.length
        if self._prefix_workspace.shape[1] < n:
            shape = (2, max(n, 2 * self._prefix_workspace.shape[1]), *self.pool.k[0].shape[1:])
            self._prefix_workspace = torch.empty(shape, dtype=self.pool.dtype)
        k, v = self._prefix_workspace[0, :n], self._prefix_workspace[1, :n]
        torch.index_select(self.pool.k[layer], 0, prefix.slots, out=k)
        torch.index_select(self.pool.v[layer], 0, prefix.slots, out=v)
        return k, v
