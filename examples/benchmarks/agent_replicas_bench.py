"""Agent traces on 2 replicas (issue 52, item 5): does routing keep a program's turns together?

    python examples/benchmarks/agent_replicas_bench.py --cells 2
    python examples/benchmarks/agent_replicas_bench.py --model smollm2-135m-instruct --agents 8

A cell is a drawn agent batch (agent_traces.py). Its exact bound comes from one engine with an
unbounded pool in this process (the same batch, nothing evicted; also the reference outputs).
Then, per row, a fresh Ray cluster of replicas (one CPU each, graph eviction with the program
gate, each pool the cell's pool over the replica count: the same KV in all as one engine's pool)
runs the batch through `ClusterBackend`, routed:

- least_loaded: request by request, the fewest in flight (no cache in view);
- cache_aware, no homes: our cost rule (tokens computed + evicted), programs not followed;
- cache_aware + homes: the same rule keeping each program on its home replica unless another
  costs `program_move_tokens` less (runtime/cluster/homes.py; the default);
- placement: the batch split across replicas up front (runtime/cluster/placement.py), each
  share run there.

Columns as agent_trace_bench.py's, plus program moves (turns routed away from the replica the
program's previous turn ran on) and each replica's prefill computed. The tiny model is saved
as a Hugging Face checkpoint with SmolLM2's tokenizer (replicas load it from disk). Both
replicas share this machine's 2 cores: counters exact, times indicative.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent_trace_bench import (
    DEFAULT_MODEL,
    UNBOUNDED_HEADROOM,
    Retrying,
    RowResult,
    completed,
    program_results,
    row_figures,
    run_row,
    run_timed,
)
from agent_traces import PRESETS, AgentBatch, draw_batch
from eviction_cells import PRESETS as MODEL_PRESETS
from eviction_cells import TINY_MODEL, TOKENIZER_MODEL

from flowlang.backends.cluster import ClusterBackend
from runtime.cluster.policy import RouterConfig
from runtime.config import EngineConfig

# row -> (router policy, program homes, placement)
ROWS = {
    "least_loaded": ("least_loaded", False, False),
    "cache_aware, no homes": ("cache_aware", False, False),
    "cache_aware + homes": ("cache_aware", True, False),
    "placement": ("cache_aware", True, True),
}


class RetryingCluster(Retrying, ClusterBackend):
    """The cluster, retried when a replica answers busy."""

    def on_replica(self, replica: int) -> RetryingCluster:
        """Placement's view of one replica: retried too, counted here."""
        view = RetryingCluster(self.cluster, self.tokenizer, replica, self.place)
        view.retried = self.retried
        return view


@dataclass(frozen=True)
class ClusterRow:
    row: RowResult
    moves: int  # program turns routed away from the program's previous replica
    per_replica: list[int]  # prefill computed per replica


def save_tiny_checkpoint(folder: Path) -> str:
    """The tiny random model (eviction_cells' preset) as a checkpoint replicas load by path."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.model.registry import resolve_model

    preset = MODEL_PRESETS[TINY_MODEL.removeprefix("random:")]
    fields = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings")  # fmt: skip
    config = LlamaConfig(**{k: preset[k] for k in fields if k in preset},
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    source = resolve_model(TOKENIZER_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)


def run_cluster_row(
    batch: AgentBatch, model: str, tokenizer, pool: int, row: str, replicas: int
) -> ClusterRow:
    """The batch on a fresh cluster routed as `row` says."""
    from runtime.cluster.cluster import Cluster, ClusterConfig

    policy, homes, place = ROWS[row]
    engine = EngineConfig(model=model, max_kv_tokens=pool, eviction_policy="graph",
                          page_size=batch.page_size, attention_backend="torch")  # fmt: skip
    router = RouterConfig(policy=policy, program_affinity=homes)
    with Cluster(engine, ClusterConfig(num_replicas=replicas, router=router)) as cluster:
        backend = RetryingCluster(cluster, tokenizer, place=place)
        states, makespan_s = run_timed(batch, backend)
        cluster.check_integrity()
        stats = cluster.stats()
        per_replica = [int(stats[i]["prefill_tokens_total"]) for i in sorted(stats)]
        evicted = sum(int(s["evicted_tokens_total"]) for s in stats.values())
        recomputed = sum(int(s["program_returns_recomputed_tokens_total"]) for s in stats.values())
        result = RowResult(sum(per_replica), evicted, *program_results(states),
                           makespan_s, 0, 0, 0, backend.retries, recomputed)  # fmt: skip
        return ClusterRow(result, cluster.router.program_homes()[1], per_replica)


def print_cell(batch: AgentBatch, unbounded: RowResult, rows: dict[str, ClusterRow], pool: int):
    bound, reference = unbounded.computed, unbounded.outputs
    print(f"\n{batch.describe()}")
    alone_s = statistics.mean(completed(unbounded.completions_s))
    print(f"working set {unbounded.working_set:,} tokens; exact bound {bound:,} prefill tokens "
          f"(one engine, unbounded: mean {alone_s:.1f} s); "
          f"each replica's pool {pool:,}")  # fmt: skip
    print(f"{'row':<24} {'prefill':>9} {'÷ bound':>8} {'mean s':>7} {'p90 s':>7} {'p99 s':>7} "
          f"{'makespan':>9} {'moves':>6} {'retries':>7} {'outputs':>8}  per replica")  # fmt: skip
    for name, cell in rows.items():
        row = cell.row
        same = "equal" if row.outputs == reference else "DIFFER"
        print(f"{name:<24} {row_figures(row, bound)} {cell.moves:>6} "
              f"{row.retries:>7} {same:>8}  {' / '.join(f'{n:,}' for n in cell.per_replica)}"
              + (f"  {len(row.failures)} failed: {row.failures[0][:120]}" if row.failures
                 else ""))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"default: the tiny random model; e.g. {DEFAULT_MODEL}")
    parser.add_argument("--agents", type=int, help="default: drawn from the preset")
    parser.add_argument("--pool-fraction", type=float, default=0.35)
    parser.add_argument("--page-size", type=int, help="default: drawn (1 or 16)")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cells", type=int, default=1, help="cells, seeds seed, seed + 1, ...")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    args = parser.parse_args()
    from runtime.cluster.ray_support import init_ray
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    init_ray(num_cpus=args.replicas)
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or save_tiny_checkpoint(Path(folder))
        tokenizer = load_tokenizer(model if args.model is None else resolve_model(model))
        shape = PRESETS["default" if args.model else "tiny"]
        print(f"model {args.model or 'tiny random (SmolLM2 tokenizer)'}, {args.replicas} replicas, "
              "graph eviction + program gate, attention torch; one run per row")  # fmt: skip
        for cell in range(args.cells):
            batch = draw_batch(
                shape, args.seed + cell, args.agents, args.pool_fraction, args.page_size
            )
            capacity = math.ceil(batch.working_set_tokens() * UNBOUNDED_HEADROOM)
            unbounded = run_row(batch, model, tokenizer, capacity, "lru", record_trace=True,
                                attention_backend="torch")  # fmt: skip
            pool = batch.pool_tokens(unbounded.working_set)
            pool = math.ceil(pool / args.replicas / batch.page_size) * batch.page_size
            rows = {
                name: run_cluster_row(batch, model, tokenizer, pool, name, args.replicas)
                for name in args.rows
            }
            print_cell(batch, unbounded, rows, pool)


if __name__ == "__main__":
    main()
