"""Scale-out: W1 and W3 on 1 vs 2 replicas (Ray) under each routing policy and with graph-aware
placement, then a model-free simulation at 8 and 32 replicas over recorded token traces.

    python examples/benchmarks/cluster_bench.py [--model PATH] [--skip-ray] [--sim-replicas 8 32]

Part 1 (Ray, local, greedy): each row runs the workload's batch once on fresh caches and reports
prefill tokens computed (sum over replicas), the cache hit rate, per-replica computed tokens
and requests/s. Both replicas share this machine's cores, so the counts are the result and the
rates only say that nothing stalls.

Part 2 (no model): the W1 and W3 bench-size prompts (the workloads' seeded inputs through the
tokenizer and chat template; replies are fixed synthetic tokens of the workload's reply length)
replayed through the router over real radix trees (runtime/cluster/simulate.py) with a
per-replica KV pool, for SGLang-style approximate routing (`approximate`: its thresholds, a
tree of what was routed, never told of evictions) vs ours. Busy imbalance is the busiest
replica's modelled busy time over the mean; req/s are in model time units.
"""

from __future__ import annotations

import argparse
import time

from programs import support_agent, tree_of_thought
from programs.text import TextBuilder, token_counter
from runtime.cluster.placement import Instance, place_batch
from runtime.cluster.policy import RouterConfig
from runtime.cluster.simulate import simulate
from runtime.prefix import prefill_lower_bound, union_prefix_tokens

MODEL = "smollm2-135m-instruct"
POLICIES = ("round_robin", "least_loaded", "cache_aware")
SIM_POLICIES = ("round_robin", "least_loaded", "approximate", "cache_aware")


# ------------------------------------------------------------------ part 1: Ray
def part1(model: str, max_kv_tokens: int) -> None:
    """W1, W3 (test size) on 1 replica, and on 2 under each policy and with placement."""
    from flowlang.backends.cluster import ClusterBackend
    from runtime.cluster.cluster import Cluster, ClusterConfig
    from runtime.cluster.ray_support import init_ray
    from runtime.config import EngineConfig
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    init_ray(num_cpus=2)
    tokenizer = load_tokenizer(resolve_model(model))
    config = EngineConfig(model=model, max_kv_tokens=max_kv_tokens)
    w1 = support_agent.batch_args(support_agent.make_inputs(tokenizer, "test"))
    w3 = [{"question": q} for q in tree_of_thought.make_inputs(tokenizer, "test")]
    workloads = {
        "W1": (support_agent.support_agent, w1),
        "W3": (tree_of_thought.tree_of_thought, w3),
    }
    print(
        "| workload | replicas | routing | prefill computed | hit rate | per-replica computed "
        "| requests | req/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for num_replicas, modes in ((1, ("cache_aware",)), (2, (*POLICIES, "placement"))):
        with Cluster(config, ClusterConfig(num_replicas=num_replicas)) as cluster:
            for name, (prog, batch) in workloads.items():
                for mode in modes:
                    backend = ClusterBackend(cluster, tokenizer, place=mode == "placement")
                    row = _run_mode(cluster, backend, prog, batch, mode)
                    print(f"| {name} | {num_replicas} | {mode} | {row} |")


def _run_mode(cluster, backend, prog, batch, mode: str) -> str:
    cluster.set_router_config(RouterConfig(policy="cache_aware" if mode == "placement" else mode))
    cluster.flush_caches()
    cluster.wait_for_events()
    before = cluster.stats()
    start = time.perf_counter()
    prog.run_batch(batch, backend=backend, progress=False)  # placed only in "placement"
    wall_s = time.perf_counter() - start
    after = cluster.stats()

    def delta(key: str) -> dict:
        """Per replica, how much a counter grew during the run."""
        return {i: after[i][key] - before[i][key] for i in after}

    computed, cached = delta("prefill_tokens_total"), delta("cached_tokens_total")
    requests = sum(delta("requests_finished_total").values())
    total = sum(computed.values())
    hit_rate = sum(cached.values()) / max(total + sum(cached.values()), 1)
    per_replica = " / ".join(str(int(computed[i])) for i in sorted(computed))
    return (
        f"{int(total):,} | {hit_rate:.1%} | {per_replica} | {int(requests)} | "
        f"{requests / wall_s:.1f}"
    )


# ------------------------------------------------------------------ part 2: simulation
def w1_trace(tokenizer) -> list:
    """W1 bench size: per user, one stage per turn; each prompt repeats the conversation."""
    inputs = support_agent.make_inputs(tokenizer, "bench")
    reply_text = TextBuilder(7, token_counter(tokenizer))
    programs = []
    for user in inputs.users:
        messages = [{"role": "system", "content": inputs.system_message(user)}]
        stages = []
        for message in user.messages:
            messages.append({"role": "user", "content": message})
            prompt = _chat_ids(tokenizer, messages)
            reply = reply_text.paragraph(inputs.reply_tokens)
            output = tuple(tokenizer.encode(reply))[: inputs.reply_tokens]
            stages.append([(None, prompt, output)])
            messages.append({"role": "assistant", "content": tokenizer.decode(list(output))})
        programs.append(stages)
    return programs


def w3_trace(tokenizer) -> list:
    """W3 bench size: per question, one stage per fork level (3, 9, 27 requests)."""
    filler = TextBuilder(11, token_counter(tokenizer))
    programs = []
    for question in tree_of_thought.make_inputs(tokenizer, "bench"):
        leaves, stages = [question + "\nLet us think in steps."], []
        for depth in range(tree_of_thought.DEPTH):
            stage, next_leaves = [], []
            for leaf in leaves:
                for i in range(tree_of_thought.WIDTH):
                    text = f"{leaf}\nStep {depth + 1}, idea {i + 1}:"
                    thought = filler.paragraph(tree_of_thought.THOUGHT_TOKENS)
                    output = tuple(tokenizer.encode(" " + thought))[
                        : tree_of_thought.THOUGHT_TOKENS
                    ]
                    stage.append((None, tuple(tokenizer.encode(text)), output))
                    next_leaves.append(text + tokenizer.decode(list(output)))
            stages.append(stage)
            leaves = next_leaves
        programs.append(stages)
    return programs


def _instance(program) -> Instance:
    """A traced program as placement sees it: first prompt, and what the rest adds."""
    requests = [r for stage in program for r in stage]
    first = requests[0][1]
    own = union_prefix_tokens([r[1] for r in requests] + [r[1] + r[2] for r in requests])
    return Instance(None, first, own - len(first))


def _chat_ids(tokenizer, messages) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return tuple(ids)


def part2(tokenizer, replica_counts: list[int], kv_tokens: int) -> None:
    """The simulation table: computed tokens and balance per policy, replica count, workload."""
    print(
        "\n| workload | replicas | routing | prefill computed | lower bound | hit rate "
        "| busy imbalance | req/s (model) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, trace in (("W1", w1_trace(tokenizer)), ("W3", w3_trace(tokenizer))):
        requests = [r for program in trace for stage in program for r in stage]
        bound = prefill_lower_bound([r[1] for r in requests], [(r[1], r[2]) for r in requests])
        instances = [_instance(program) for program in trace]
        for num_replicas in replica_counts:
            modes = [(policy, None) for policy in SIM_POLICIES]
            modes.append(("placement", place_batch(instances, num_replicas)))
            for mode, placement in modes:
                config = RouterConfig(policy="cache_aware" if placement else mode)
                result = simulate(
                    trace, num_replicas, config, kv_tokens, len(trace), placement=placement
                )
                rate = result.num_requests / result.makespan * 1000
                print(
                    f"| {name} | {num_replicas} | {mode} | {result.num_computed_tokens:,} | "
                    f"{bound:,} | {result.hit_rate:.1%} | {result.load_imbalance:.2f} | "
                    f"{rate:.2f} |"
                )


def main() -> None:
    """Parse options, print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--max-kv-tokens", type=int, default=16_384, help="per replica (Ray)")
    parser.add_argument("--skip-ray", action="store_true")
    parser.add_argument("--sim-replicas", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--sim-kv-tokens", type=int, default=16_384, help="per replica")
    args = parser.parse_args()
    if not args.skip_ray:
        part1(args.model, args.max_kv_tokens)
    from runtime.model.loader import load_tokenizer
    from runtime.model.registry import resolve_model

    part2(load_tokenizer(resolve_model(MODEL)), args.sim_replicas, args.sim_kv_tokens)


if __name__ == "__main__":
    main()
