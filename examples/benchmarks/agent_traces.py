"""The agent-trace family (W7, issue 52): seeded batches of coding agents, no engine needed.

A batch: agents that share one system prompt with typed tools, each with a private context,
then rounds of an assistant turn that must call a tool whose result is appended; some rounds
make two calls at once; a share of the agents fork subagents that share the agent's prefix,
run rounds of their own and report back after the join. Tool gaps follow a coding-agent
distribution (GAP_BUCKETS: 86% of returns within 1 s, 95% within 10 s, a tail to a minute),
multiplied by the batch's `time_scale` so that a small machine runs it in minutes.

A FamilyShape holds the ranges a batch is drawn from; draw_batch draws one batch (its agent
count, subagent share and parallel-call share too, unless fixed), with the pool share and page
size of its cell. programs/agent_trace.py replays one agent; agent_trace_bench.py runs cells.

>>> batch = draw_batch(PRESETS["tiny"], seed=0)
>>> len(batch.agents), batch.page_size in (1, 16)
(8, True)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from programs.agent_trace import (
    AgentTrace,
    RoundTrace,
    SubagentTrace,
    ToolCallTrace,
    words_text,
)

# (share of returns, shortest s, longest s, the tools whose calls take that long); within a
# bucket gaps are log-uniform. Coding-agent traces: most calls read or edit files at once,
# some run commands for seconds, a few run test suites for tens of seconds.
GAP_BUCKETS = (
    (0.86, 0.02, 1.0, ("read_file", "search_code", "edit_file")),
    (0.09, 1.0, 10.0, ("run_command",)),
    (0.05, 10.0, 60.0, ("run_tests",)),
)
MESSAGE_OVERHEAD_TOKENS = 8  # role markup and tool-response tags around each message
TOOLS_PROMPT_TOKENS = 700  # the tools' definitions in the system prompt (SmolLM2, measured)

Span = tuple[int, int]  # inclusive bounds


@dataclass(frozen=True)
class FamilyShape:
    """The ranges a batch is drawn from (inclusive; token counts in SmolLM2 tokens)."""

    agents: Span = (8, 64)
    context_tokens: Span = (300, 3000)
    rounds: Span = (4, 40)  # drawn log-uniform: many short agents, a few long ones
    assistant_tokens: Span = (20, 60)
    result_tokens: Span = (30, 400)
    spawn_share: tuple[float, float] = (0.25, 0.45)  # of agents that fork subagents
    subagents: Span = (2, 4)
    subagent_rounds: Span = (2, 4)
    subagent_task_tokens: Span = (40, 200)
    report_tokens: Span = (16, 48)
    answer_tokens: Span = (16, 48)
    parallel_share: tuple[float, float] = (0.1, 0.3)  # of rounds that make two calls
    system_tokens: int = 300
    pool_share: tuple[float, float] = (0.25, 0.60)  # pool slots / working set
    page_sizes: tuple[int, ...] = (1, 16)
    time_scale: float = 1.0  # gaps are multiplied by it
    # programs arrive as a Poisson process at this rate (wall seconds); 0: all at once
    arrivals_per_s: float = 0.0


PRESETS = {
    "family": FamilyShape(),  # the whole range (a GPU's work at its upper end)
    # one cell in a few minutes per engine on 2 CPU cores with the default model
    "default": FamilyShape(
        agents=(10, 12), rounds=(4, 6), context_tokens=(300, 1500), time_scale=0.1
    ),
    # seconds on the tiny random model (tests)
    "tiny": FamilyShape(
        agents=(8, 8),
        context_tokens=(300, 500),
        rounds=(4, 5),
        assistant_tokens=(20, 28),
        result_tokens=(30, 80),
        subagent_rounds=(2, 2),
        subagent_task_tokens=(40, 60),
        report_tokens=(8, 12),
        answer_tokens=(8, 12),
        system_tokens=100,
        time_scale=0.01,
    ),
}


@dataclass(frozen=True)
class AgentBatch:
    """One drawn batch and its cell's pool share and page size."""

    seed: int
    shape: FamilyShape
    agents: tuple[AgentTrace, ...]
    spawn_share: float  # drawn from shape.spawn_share
    parallel_share: float  # drawn from shape.parallel_share
    pool_share: float
    page_size: int

    @property
    def system_prompt(self) -> str:
        return "You are a coding agent. " + words_text(self.shape.system_tokens, f"{self.seed}:s")

    @property
    def time_scale(self) -> float:
        return self.shape.time_scale

    def batch_args(self) -> list[dict]:
        """run_batch arguments for programs.agent_trace.agent_trace."""
        return [
            {"trace": a, "system_prompt": self.system_prompt, "time_scale": self.time_scale}
            for a in self.agents
        ]

    def working_set_tokens(self) -> int:
        """Tokens of distinct KV the batch holds when nothing is evicted: the shared system
        prompt once, then every agent's own (an estimate: markup counted per message)."""
        shared = self.shape.system_tokens + TOOLS_PROMPT_TOKENS
        return shared + sum(agent_tokens(a) for a in self.agents)

    def pool_tokens(self, working_set: int | None = None) -> int:
        """The pool for this cell: pool_share of the working set, in whole pages."""
        tokens = int((working_set or self.working_set_tokens()) * self.pool_share)
        return max(self.page_size, tokens // self.page_size * self.page_size)

    def describe(self) -> str:
        rounds = [len(a.rounds) for a in self.agents]
        spawning = sum(bool(a.subagents) for a in self.agents)
        per_s = self.shape.arrivals_per_s
        return (
            f"{len(self.agents)} agents (seed {self.seed}), {min(rounds)}-{max(rounds)} rounds, "
            f"{spawning} forking {sum(len(a.subagents) for a in self.agents)} subagents, "
            f"parallel rounds {self.parallel_share:.0%}, gaps x{self.time_scale:g}, "
            f"pool {self.pool_share:.0%} of the working set, page size {self.page_size}"
            + (f", arriving at {per_s:g}/s" if per_s else "")
        )


def rounds_tokens(rounds: tuple[RoundTrace, ...]) -> int:
    return sum(
        r.assistant_tokens + MESSAGE_OVERHEAD_TOKENS
        + sum(c.result_tokens + MESSAGE_OVERHEAD_TOKENS for c in r.calls)
        for r in rounds
    )  # fmt: skip


def agent_tokens(agent: AgentTrace) -> int:
    """One agent's own KV: context, rounds, subagents (each its task, rounds and report), the
    reports read after the join, the answer."""
    own = agent.context_tokens + rounds_tokens(agent.rounds) + agent.answer_tokens
    subs = sum(
        s.task_tokens + rounds_tokens(s.rounds) + s.report_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
        for s in agent.subagents
    )
    reports = sum(s.report_tokens + 1 for s in agent.subagents)
    return own + subs + reports + 3 * MESSAGE_OVERHEAD_TOKENS


def agent_rounds(agent: AgentTrace) -> int:
    """An agent's size in model calls: its rounds and every subagent's (a 2-round agent that
    forks subagents of 6 rounds each asks for more than a 7-round one that does not)."""
    return len(agent.rounds) + sum(len(s.rounds) for s in agent.subagents)


# ---------------------------------------------------------------------- drawing


def draw_gap_s(rng: random.Random) -> tuple[float, str]:
    """A tool gap in seconds (before time_scale) and the tool that takes that long."""
    u = rng.random()
    for share, lo_s, hi_s, tools in GAP_BUCKETS:
        if u < share:
            return math.exp(rng.uniform(math.log(lo_s), math.log(hi_s))), rng.choice(tools)
        u -= share
    _, lo_s, hi_s, tools = GAP_BUCKETS[-1]  # float rounding at u ~ 1
    return hi_s, tools[0]


def log_uniform_int(rng: random.Random, span: Span) -> int:
    return min(span[1], int(math.exp(rng.uniform(math.log(span[0]), math.log(span[1] + 1)))))


def draw_round(rng: random.Random, shape: FamilyShape, parallel_share: float) -> RoundTrace:
    calls = []
    for _ in range(2 if rng.random() < parallel_share else 1):
        gap_s, name = draw_gap_s(rng)
        argument = f"src/{rng.choice(('core', 'api', 'db', 'ui'))}/part_{rng.randrange(100)}.py"
        calls.append(ToolCallTrace(name, argument, rng.randint(*shape.result_tokens), gap_s))
    return RoundTrace(rng.randint(*shape.assistant_tokens), tuple(calls))


def draw_agent(
    rng: random.Random, shape: FamilyShape, key: str, spawns: bool, parallel_share: float
) -> AgentTrace:
    num_rounds = log_uniform_int(rng, shape.rounds)
    rounds = tuple(draw_round(rng, shape, parallel_share) for _ in range(num_rounds))
    subagents: tuple[SubagentTrace, ...] = ()
    fork_after = None
    if spawns:
        fork_after = rng.randrange(num_rounds - 1)  # the parent goes on after the join
        subagents = tuple(
            SubagentTrace(
                rng.randint(*shape.subagent_task_tokens),
                tuple(
                    draw_round(rng, shape, parallel_share)
                    for _ in range(rng.randint(*shape.subagent_rounds))
                ),
                rng.randint(*shape.report_tokens),
            )
            for _ in range(rng.randint(*shape.subagents))
        )
    return AgentTrace(
        key,
        rng.randint(*shape.context_tokens),
        rounds,
        rng.randint(*shape.answer_tokens),
        fork_after,
        subagents,
    )


def spawner_count(num_agents: int, share: float, bounds: tuple[float, float]) -> int:
    """How many agents fork: near `share`, and always inside `bounds` as a fraction."""
    lowest, highest = math.ceil(bounds[0] * num_agents), math.floor(bounds[1] * num_agents)
    if lowest > highest:
        raise ValueError(f"{num_agents} agents cannot fork a share within {bounds}")
    return min(highest, max(lowest, round(share * num_agents)))


def draw_batch(
    shape: FamilyShape,
    seed: int = 0,
    num_agents: int | None = None,
    pool_share: float | None = None,
    page_size: int | None = None,
) -> AgentBatch:
    """A batch drawn from `shape` with `seed`; each of the last three is drawn unless given."""
    rng = random.Random(seed)
    n = num_agents if num_agents is not None else rng.randint(*shape.agents)
    spawn_share = rng.uniform(*shape.spawn_share)
    parallel_share = rng.uniform(*shape.parallel_share)
    pool = pool_share if pool_share is not None else rng.uniform(*shape.pool_share)
    page = page_size if page_size is not None else rng.choice(shape.page_sizes)
    num_spawning = spawner_count(n, spawn_share, shape.spawn_share)
    spawning = set(rng.sample(range(n), num_spawning))
    agents = tuple(
        draw_agent(rng, shape, f"{seed}:a{i}", i in spawning, parallel_share) for i in range(n)
    )
    if shape.arrivals_per_s > 0:  # (their own generator: the agents drawn stay the same)
        agents = arriving(agents, shape.arrivals_per_s, random.Random(f"{seed}:arrivals"))
    return AgentBatch(seed, shape, agents, spawn_share, parallel_share, pool, page)


def arriving(
    agents: tuple[AgentTrace, ...], per_s: float, rng: random.Random
) -> tuple[AgentTrace, ...]:
    """The agents arriving as a Poisson process at `per_s`, in a drawn order (so short and
    long programs mix through the run), the first at 0."""
    order = rng.sample(range(len(agents)), len(agents))
    arrival_s, arrivals = 0.0, [0.0] * len(agents)
    for position, index in enumerate(order):
        if position:
            arrival_s += rng.expovariate(per_s)
        arrivals[index] = arrival_s
    return tuple(replace(a, arrival_s=t) for a, t in zip(agents, arrivals, strict=True))


def vary(shape: FamilyShape, **changes) -> FamilyShape:
    """`shape` with some ranges changed (e.g. `vary(PRESETS["default"], rounds=(10, 40))`)."""
    return replace(shape, **changes)
