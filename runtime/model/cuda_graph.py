"""CUDA-graph decode: pure-decode batches replayed from graphs captured at fixed batch sizes.

A decode step of a small batch is launch-bound on an H100/H200: a few hundred kernels of a few
microseconds each, issued one by one from Python. Captured once per batch size, a step is one
graph launch. A batch of n decodes is padded to the next captured size with entries that read
and write the pool's scratch page (never handed out, so padding touches no one's KV); batches
larger than the largest size, or with anything but one new token per sequence, run eagerly.

Inputs live in static buffers the graphs captured by address: each replay copies the batch's
token ids, positions and output slots into them, plans attention for the padded batch (the
backend writes its page table into its own static buffers), replays, and copies the real rows
of the static logits out. The bookkeeping is device-independent: on CPU `EagerStep` stands in
for a captured graph, so padding and buffers are tested without CUDA.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from runtime.cache.pool import KVPool
from runtime.model.attention.base import AttentionBackend
from runtime.model.batch import ForwardBatch
from runtime.model.llama import LlamaModel


def capture_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of half the last power of two (16, 24, 32, 48, 64, 96, ...), up
    to and including `max_batch_size`: padding wastes at most a third of a step past 8."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        if size < 8:
            size *= 2
        else:
            power = 1 << (size.bit_length() - 1)
            size += power // 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def padded_batch_size(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size holding `num_seqs`, or None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_plain_decode(batch: ForwardBatch) -> bool:
    """One new token per sequence, logits for each: what a decode graph computes."""
    return all(e == 1 for e in batch.extend_lens) and batch.logit_rows.tolist() == list(
        range(batch.num_seqs)
    )


def pad_decode_batch(batch: ForwardBatch, size: int, scratch_slot: int) -> ForwardBatch:
    """`batch` and size - num_seqs padding decodes: token 0 at position 0 in the scratch slot."""
    pad = size - batch.num_seqs
    if pad < 0:
        raise ValueError(f"a batch of {batch.num_seqs} does not fit a graph of size {size}")
    if pad == 0:
        return batch
    scratch = torch.tensor([scratch_slot], dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.cat([batch.input_ids, torch.zeros(pad, dtype=torch.int64)]),
        positions=torch.cat([batch.positions, torch.zeros(pad, dtype=torch.int64)]),
        out_slots=torch.cat([batch.out_slots, scratch.expand(pad)]),
        extend_lens=batch.extend_lens + (1,) * pad,
        seq_lens=batch.seq_lens + (1,) * pad,
        kv_slots=batch.kv_slots + (scratch,) * pad,
        logit_rows=torch.arange(size, dtype=torch.int64),
    )


_NO_TOKENS = torch.zeros(0, dtype=torch.int64)
_EMPTY_BATCH = ForwardBatch(_NO_TOKENS, _NO_TOKENS, _NO_TOKENS, (), (), (), _NO_TOKENS)


class StaticDecodeInputs:
    """Token ids, positions and output slots of up to `max_batch_size` decodes, at fixed
    device addresses; one host-to-device copy per step (from pinned memory on CUDA)."""

    def __init__(self, max_batch_size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        # rows: input ids, positions, out slots; (3, max_batch_size)
        self._host = torch.zeros((3, max_batch_size), dtype=torch.int64, pin_memory=pin)
        self._device = torch.zeros((3, max_batch_size), dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_slots = self._device.unbind(0)
        self.logit_rows = torch.arange(max_batch_size, device=device)

    def load(self, padded: ForwardBatch) -> None:
        n = padded.num_seqs
        self._host[0, :n] = padded.input_ids
        self._host[1, :n] = padded.positions
        self._host[2, :n] = padded.out_slots
        self._device[:, :n].copy_(self._host[:, :n], non_blocking=True)


class EagerStep:
    """Runs the step function on every replay: the stand-in for a graph where CUDA is absent."""

    def __init__(self, fn: Callable[[], torch.Tensor], memory_pool: object = None) -> None:
        self._fn = fn

    def replay(self) -> torch.Tensor:
        return self._fn()


class CudaGraphStep:
    """The step function captured once into a CUDA graph; replay re-runs its kernels on
    whatever the static buffers hold and returns the same output tensor each time."""

    def __init__(self, fn: Callable[[], torch.Tensor], memory_pool: object = None) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: lazy inits and autotuning stay out of the graph
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph, pool=memory_pool):
            self._output = fn()

    def replay(self) -> torch.Tensor:
        self._graph.replay()
        return self._output


class DecodeGraphs:
    """Decode steps replayed from graphs captured at `capture_batch_sizes(max_batch_size)`."""

    def __init__(
        self,
        model: LlamaModel,
        attention: AttentionBackend,
        pool: KVPool,
        max_batch_size: int,
        step_type: type[EagerStep] | type[CudaGraphStep] = CudaGraphStep,
    ) -> None:
        if pool.scratch_slots < max(1, getattr(attention, "page_size", 1)):
            raise ValueError("decode graphs need a scratch page in the pool for padding")
        self.model, self.attention, self.pool = model, attention, pool
        self.sizes = capture_batch_sizes(max_batch_size)
        self.max_seq_len = model.arch.max_context_len
        self.inputs = StaticDecodeInputs(max_batch_size, pool.device)
        self.num_replays = 0
        self._rope_tables = model.ensure_rope(self.max_seq_len)  # read in place by the graphs
        attention.prepare_decode_graphs(self.sizes, self.max_seq_len)
        memory_pool = torch.cuda.graph_pool_handle() if step_type is CudaGraphStep else None
        self._steps: dict[int, EagerStep | CudaGraphStep] = {}
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            padded = pad_decode_batch(_EMPTY_BATCH, size, pool.scratch_slot)  # all padding
            self.inputs.load(padded)
            attention.plan_graph_decode(padded, self.inputs.out_slots[:size])
            self._steps[size] = step_type(self._step_fn(size), memory_pool)

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        inputs = self.inputs

        def step() -> torch.Tensor:  # (size, vocab) fp32 logits
            return self.model.forward_tokens(
                inputs.input_ids[:size],
                inputs.positions[:size],
                inputs.logit_rows[:size],
                self.attention,
            )

        return step

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.num_seqs <= self.sizes[-1]
            and max(batch.seq_lens) <= self.max_seq_len
            and is_plain_decode(batch)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits (num_seqs, vocab) of a batch that `can_run`."""
        size = padded_batch_size(batch.num_seqs, self.sizes)
        padded = pad_decode_batch(batch, size, self.pool.scratch_slot)
        self.inputs.load(padded)
        self.attention.plan_graph_decode(padded, self.inputs.out_slots[:size])
        logits = self._steps[size].replay()
        self.num_replays += 1
        return logits[: batch.num_seqs].clone()  # the static output is overwritten next step
