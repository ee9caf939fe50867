"""ForwardBatch: one mixed, ragged batch of extends (prefill after a cached prefix) and decodes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    """Sequence i feeds `extend_lens[i]` new tokens after `seq_lens[i] - extend_lens[i]` cached.

    A decode is an extend of one token. Tokens of all sequences are concatenated, no padding.
    """

    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    out_slots: torch.Tensor  # (num_tokens,) int64: where each new token's K/V is written
    extend_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    kv_slots: tuple[torch.Tensor, ...]  # per sequence (seq_lens[i],) slots: cached prefix + new
    logit_rows: torch.Tensor  # (num_logit_rows,) token rows whose next-token logits are wanted

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        return tuple(s - e for s, e in zip(self.seq_lens, self.extend_lens, strict=True))

    @classmethod
    def build(
        cls,
        new_token_ids: Sequence[Sequence[int]],
        kv_slots: Sequence[torch.Tensor],
        all_logits: Sequence[bool] | None = None,
        no_logits: Sequence[bool] | None = None,
        logit_tails: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """Batch sequences given their new tokens and full slot lists (cached prefix + new).

        Logits are produced for the last new token of each sequence, for every new token of
        the sequences flagged in `all_logits` (prompt logprobs, scoring), and for none of the
        sequences flagged in `no_logits` (a prefill chunk that is not the last). `logit_tails`,
        if given, says it per sequence instead: logits for its last n new tokens (a draft
        being verified wants one row per draft token plus one).
        """
        if len(new_token_ids) != len(kv_slots):
            raise ValueError("one slot list per sequence is needed")
        extend_lens = tuple(len(t) for t in new_token_ids)
        seq_lens = tuple(int(s.numel()) for s in kv_slots)
        if any(e < 1 or e > s for e, s in zip(extend_lens, seq_lens, strict=True)):
            raise ValueError("each sequence needs 1..seq_len new tokens")
        if logit_tails is None:
            flags = all_logits or (False,) * len(extend_lens)
            skips = no_logits or (False,) * len(extend_lens)
            logit_tails = [
                e if want_all else int(not skip)
                for e, want_all, skip in zip(extend_lens, flags, skips, strict=True)
            ]
        positions, rows, start = [], [], 0
        for e, s, tail in zip(extend_lens, seq_lens, logit_tails, strict=True):
            if not 0 <= tail <= e:
                raise ValueError(f"logits for {tail} of {e} new tokens")
            positions.append(torch.arange(s - e, s, dtype=torch.int64))
            rows.extend(range(start + e - tail, start + e))
            start += e
        return cls(
            input_ids=torch.tensor([t for toks in new_token_ids for t in toks], dtype=torch.int64),
            positions=torch.cat(positions),
            out_slots=torch.cat(
                [s[s.numel() - e :] for s, e in zip(kv_slots, extend_lens, strict=True)]
            ),
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            kv_slots=tuple(kv_slots),
            logit_rows=torch.tensor(rows, dtype=torch.int64),
        )
