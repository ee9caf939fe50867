"""Engine replicas as Ray actors on CUDA (issue 17's GPU part): two replicas sharing one GPU
(`num_gpus_per_replica=0.5`), each a CUDA engine, against one engine on the same GPU.

    python examples/benchmarks/gpu_cluster_check.py --device cuda --out FILE   # on the device
    python examples/benchmarks/gpu_cluster_check.py --device cpu               # dry run here

On the device, gpu_check.sh runs it as its cluster stage (Ray from the carried, trimmed tree),
without flashinfer on the path: the engines here are fp32 on the torch reference, and
flashinfer's fused norm kernels take only bf16/fp16.

Checks (each a line of the printed table; the exit status is 1 if any fails):
- placement: every replica's engine runs on the device Ray gave it (GPU ids per replica);
- outputs: greedy (fp32) outputs of the cluster under round-robin equal one engine's;
- routing: cache-aware keeps requests sharing a prefix together (the single engine's computed
  count), round-robin computes the shared prefix on both replicas;
- events: each replica's event-fed tree in the router equals the replica's own; invariants hold;
- faults: a replica killed mid-run loses no request (every answer equals one engine's).
Wall times are printed for reading, never checked.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from runtime.cluster.cluster import Cluster, ClusterConfig  # noqa: E402
from runtime.cluster.policy import RouterConfig  # noqa: E402
from runtime.cluster.ray_support import init_ray  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.protocol import GenerateRequest, SamplingParams  # noqa: E402

SHARED_TOKENS = 384  # a prefix every request shares
NUM_REQUESTS = 16


def requests(max_new_tokens: int = 16) -> list[GenerateRequest]:
    """Requests sharing one prefix, each with its own 32-token tail (greedy, fixed length)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    shared = [(7 * i) % 200 + 10 for i in range(SHARED_TOKENS)]  # ids < 512: every preset
    return [
        GenerateRequest(
            input_ids=shared + [(250 + 5 * r + j) % 500 + 3 for j in range(32)], sampling=sampling
        )
        for r in range(NUM_REQUESTS)
    ]


def computed(cluster: Cluster) -> dict[int, float]:
    return {i: s["prefill_tokens_total"] for i, s in cluster.stats().items()}


def num_equal(results, expected) -> int:
    """How many results ran to length with the expected greedy output."""
    return sum(
        r.finish_reason == "length" and r.output_ids == e
        for r, e in zip(results, expected, strict=True)
    )


def run_policy(cluster: Cluster, policy: str, batch: list[GenerateRequest]):
    """Outputs and per-replica computed tokens of one batch on fresh caches."""
    cluster.set_router_config(RouterConfig(policy=policy))
    cluster.flush_caches()
    cluster.wait_for_events()
    before = computed(cluster)
    start = time.perf_counter()
    results = cluster.generate(batch)
    wall_s = time.perf_counter() - start
    after = computed(cluster)
    return results, {i: int(after[i] - before[i]) for i in after}, wall_s


def check(device: str) -> list[tuple[str, bool, str]]:
    """Every check as (name, passed, detail)."""
    import ray

    config = EngineConfig(
        model="random:llama-3-small" if device == "cuda" else "random:tiny",
        device=device,
        dtype="float32",
        attention_backend="torch",
        max_kv_tokens=8192,
    )
    batch = requests()
    with Engine(config) as single:
        start = time.perf_counter()
        answers = single.generate(batch)
        if any(r.finish_reason != "length" for r in answers):
            raise RuntimeError(f"one engine did not run the batch: {answers[0].error}")
        expected = [r.output_ids for r in answers]
        single_s = time.perf_counter() - start
        single_computed = int(single.stats()["prefill_tokens_total"])
    rows = []
    init_ray(num_cpus=4)
    cluster_config = ClusterConfig(num_replicas=2, num_gpus_per_replica=0.5)
    with Cluster(config, cluster_config) as cluster:
        places = ray.get([a.placement.remote() for a in cluster.actors.values()])
        on_device = all(p["device"] == device for p in places)
        if device == "cuda":
            on_device = on_device and all(p["gpu_ids"] for p in places)
        rows.append(("placement", on_device, "; ".join(str(p) for p in places)))

        results, per_replica, wall_s = run_policy(cluster, "round_robin", batch)
        same = num_equal(results, expected)
        rows.append(
            (
                "outputs (round_robin)",
                same == len(batch),
                f"{same}/{len(batch)} equal one engine's; computed {per_replica}; "
                f"{wall_s:.2f} s (one engine {single_s:.2f} s)",
            )
        )
        shared_on_both = min(per_replica.values()) >= SHARED_TOKENS
        rows.append(("round_robin repeats the prefix", shared_on_both, f"computed {per_replica}"))

        results, per_replica, wall_s = run_policy(cluster, "cache_aware", batch)
        total = sum(per_replica.values())
        rows.append(
            (
                "cache_aware computes as one engine",
                total <= 1.05 * single_computed and num_equal(results, expected) == len(batch),
                f"computed {total} (one engine {single_computed}); {wall_s:.2f} s",
            )
        )

        cluster.wait_for_events()
        equal = True
        for replica_id in cluster.router.replica_ids:
            truth = ray.get(cluster.actors[replica_id].peek_snapshot.remote())
            mirror = cluster.router.tree(replica_id)
            equal = (
                equal
                and mirror.last_seq == truth.seq
                and mirror.num_tokens == sum(len(e.token_ids) - e.start_len for e in truth.stored)
            )
        cluster.check_integrity()
        rows.append(("events rebuild each tree", equal, "token counts and seqs per replica"))

        cluster.set_router_config(RouterConfig(policy="round_robin"))
        futures = [cluster.submit(r) for r in batch]
        time.sleep(0.05)
        ray.kill(cluster.actors[1], no_restart=False)
        answers = [f.result(timeout=300) for f in futures]
        same = num_equal(answers, expected)
        rows.append(
            (
                "replica killed mid-run",
                same == len(batch),
                f"{same}/{len(batch)} answered as one engine; reruns {cluster.num_reruns}",
            )
        )
    ray.shutdown()
    return rows


def main() -> int:
    """Run the checks, print (and write) the table; 1 if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args()
    rows = check(args.device)
    lines = ["| check | passed | detail |", "| --- | --- | --- |"]
    lines += [f"| {name} | {'yes' if ok else 'NO'} | {detail} |" for name, ok, detail in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
