"""Cascade attention: a prefix that many sequences of a batch share is attended once for all.

Sequences that grew from one cached prefix (every user of a support agent behind its 2k-token
system prompt) hold the same slots for that prefix. Attended sequence by sequence, a decode step
reads those K/V rows once per sequence and meets them with one query row at a time (memory-bound
dot products). Attended together, the shared rows meet all the sequences' query rows in one
GEMM-shaped flash-attention call; each sequence's own suffix is attended alone; the two partial
results merge exactly by their log-sum-exp (as flashinfer's cascade attention does on GPUs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(frozen=True)
class SharedPrefix:
    """`length` leading slots common to the sequences `members` (indices in the batch), all
    cached before this step, so every new query row of every member attends to all of them."""

    members: tuple[int, ...]
    length: int
    slots: torch.Tensor  # (length,)
    first_slot: int | None  # set when the slots are one ascending run: K/V read as a view


def find_shared_prefixes(
    kv_slots: Sequence[torch.Tensor], prefix_lens: Sequence[int], min_tokens: int
) -> list[SharedPrefix]:
    """Disjoint groups of >= 2 sequences sharing >= min_tokens cached leading slots.

    Sequences sorted by their cached slots put every set that shares a prefix side by side,
    and the common prefix of a run of them is the least common prefix of its neighbours (as
    with a suffix array). The run that saves the most K/V reads (shared length x members) is
    taken, then the best runs left of it and right of it, and so on.
    """
    # big-endian bytes of non-negative int64s order as the slot lists do, and compare in C
    # (a list of Python ints per sequence cost milliseconds per decode step at W1's lengths)
    order = sorted(
        (i for i, n in enumerate(prefix_lens) if n >= min_tokens),
        key=lambda i: kv_slots[i][: prefix_lens[i]].numpy().astype(">i8").tobytes(),
    )
    # common[k]: cached slots shared by order[k] and order[k + 1]
    common = [
        _common_prefix(kv_slots[a], kv_slots[b], min(prefix_lens[a], prefix_lens[b]))
        for a, b in pairwise(order)
    ]
    groups, spans = [], [(0, len(common))]
    while spans:
        lo, hi = spans.pop()
        best = _best_run(common, lo, hi)
        if best is None or best[2] < min_tokens:
            continue
        first, last, length = best  # neighbour pairs first..last-1: members first..last
        members = tuple(order[first : last + 1])
        slots = kv_slots[members[0]][:length]
        groups.append(SharedPrefix(members, length, slots, _ascending_run_start(slots)))
        spans += [(lo, first - 1), (last + 1, hi)]
    return groups


def _best_run(common: list[int], lo: int, hi: int) -> tuple[int, int, int] | None:
    """The neighbour pairs lo..hi-1 -> (first, last, shared): the members first..last (sorted
    positions) whose shared length times count is largest; pair k joins members k and k + 1."""
    best, best_saved = None, 0
    stack: list[int] = []  # pairs with ascending common lengths
    for k in range(lo, hi + 1):
        height = common[k] if k < hi else -1  # a sentinel pops everything at the end
        while stack and common[stack[-1]] >= height:
            top = stack.pop()
            left = stack[-1] + 1 if stack else lo
            saved = common[top] * (k - left + 1)  # pairs left..k-1: k - left + 1 members
            if saved > best_saved:
                best, best_saved = (left, k, common[top]), saved
        stack.append(k)
    return best


def in_whole_chunks(prefix: SharedPrefix, chunk: int) -> SharedPrefix:
    """`prefix` cut back to a multiple of `chunk` keys (possibly none), where a sequence attended
    alone ends a chunk of its keys: the cut prefix continues into each suffix exactly."""
    length = prefix.length - prefix.length % chunk
    if length == prefix.length:
        return prefix
    slots = prefix.slots[:length]
    first = prefix.first_slot if length else None
    return SharedPrefix(prefix.members, length, slots, first)


def prefix_of_one(member: int, slots: torch.Tensor) -> SharedPrefix:
    """The cached prefix of one sequence, attended as the first half of a cascade."""
    return SharedPrefix((member,), slots.numel(), slots, _ascending_run_start(slots))


def _common_prefix(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    limit = min(limit, a.numel(), b.numel())
    differs = (a[:limit] != b[:limit]).nonzero()
    return int(differs[0]) if differs.numel() else limit


def _ascending_run_start(slots: torch.Tensor) -> int | None:
    first = int(slots[0])
    if int(slots[-1]) - first != slots.numel() - 1:
        return None
    return first if bool((slots == torch.arange(first, first + slots.numel())).all()) else None


def flash_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, heads, d) over k/v (L, kv_heads, d) -> out (n, heads, d), lse (n, heads) fp32.

    The heads sharing a KV head are folded into the query length, so the call is one flash
    attention per KV head with n * group query rows (no repeated K/V): several times faster
    on CPU than SDPA's enable_gqa path. `mask`, if given, is additive, (n, L), per query row.
    """
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # (1, kv_heads, n * group, d): row r * group + g is query row r, head kv * group + g
    folded = (
        q.view(n, num_kv_heads, group, head_dim)
        .transpose(0, 1)
        .reshape(1, num_kv_heads, -1, head_dim)
    )
    if mask is not None:
        mask = mask.repeat_interleave(group, dim=0)[None, None]  # (1, 1, n * group, L)
    out, lse = _flash_with_lse(
        folded, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )
    out = (
        out.reshape(num_kv_heads, n, group, head_dim)
        .transpose(0, 1)
        .reshape(n, num_heads, head_dim)
    )
    lse = lse.reshape(num_kv_heads, n, group).transpose(0, 1).reshape(n, num_heads)
    return out, lse


def causal_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention among n new tokens: q (n, heads, d), k/v (n, kv_heads, d) -> out
    (n, heads, d), lse (n, heads). K/V are repeated per query head (a small copy): flash skips
    the masked half with is_causal, which the folded layout cannot express."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]  # (1, heads, n, d)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    out, lse = _flash_with_lse(q.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)


def causal_suffix_mask(num_new: int, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """(num_new, num_keys) additive mask: the new rows are the last keys, causal among them."""
    q_pos = torch.arange(num_keys - num_new, num_keys)[:, None]
    k_pos = torch.arange(num_keys)[None, :]
    mask = torch.zeros(num_new, num_keys, dtype=dtype)
    return mask.masked_fill_(k_pos > q_pos, float("-inf"))


def merge_partial(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over keys A and B from attention over each: (n, heads, d) by lse (n, heads).
    The reference for the CPU backend's native merge."""
    top = torch.maximum(lse_a, lse_b)
    w_a = torch.exp(lse_a - top)[..., None]
    w_b = torch.exp(lse_b - top)[..., None]
    merged = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return merged.to(out_a.dtype)
