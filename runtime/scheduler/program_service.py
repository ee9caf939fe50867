"""A program's record for the program gate (programs.py): when it was first seen, its requests
running, its attained service along its critical path (Autellix's ATLAS), and where its
branches paused on their tools (what a branch back computes again of that path is counted).

Least attained service first (PLAS) favours short programs over long ones. A program that forks
(subagents, parallel calls) computes on several branches at once; summing them would rank it
behind a sequential program that has waited as long, so its service is that of its longest path:
a branch counts what it computed on top of the path it forked from (branch ids are
hierarchical: "0.2" forked from "0"), and a branch continuing after a join counts from the
longest of the branches that joined into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.cache.nodes import TreeNode, path_shares

MAX_PROGRAM_BRANCHES = 64  # branch paths remembered per program (the oldest dropped first)
TRUNK = "0"  # the branch of a program's first request (flowlang's executor numbering)


@dataclass
class ProgramRecord:
    """One program as the gate sees it.

    >>> record = ProgramRecord(0.0)
    >>> record.charge("0", 100); record.charge("0.0", 50); record.charge("0.1", 30)
    >>> record.critical_tokens  # 100 + 50, not 180
    150
    >>> record.charge("0", 10); record.critical_tokens  # after the join: the longest path on
    160
    >>> record.charge("0.1", 5); record.path_tokens["0.1"]  # a second fork: from the trunk
    165
    """

    first_seen_s: float  # when its first request came (the scheduler's clock)
    num_running: int = 0  # its requests running now
    critical_tokens: int = 0  # tokens computed along its longest path so far
    priority: int = 0  # GraphHints.priority of its latest request to start (higher first)
    path_tokens: dict[str, int] = field(default_factory=dict)  # per branch: along its path
    # per branch paused on its tools: the tree node its path ended at (the object, its key
    # and its parents outlive the node's eviction)
    paused_nodes: dict[str, TreeNode] = field(default_factory=dict)
    # its growth: what its first request computed (None: not started since its work last
    # ended), and the tokens computed and decoded after it, on every branch (what its
    # footprint in the pool grew by, recompute included)
    first_tokens: int | None = None
    grown_tokens: int = 0
    # its first request waits on what no one knows ahead (program_growth.py: only such
    # programs' growth is reserved and learned)
    growth_unknown: bool = False

    def computed(self, tokens: int, unknown: bool = False) -> None:
        """A request of it starts and computes `tokens` of prompt (its growth); a first request
        may wait on what no one knows ahead (`unknown`)."""
        if self.first_tokens is None:
            self.first_tokens, self.growth_unknown = tokens, unknown
        else:
            self.grown_tokens += tokens

    def decoded(self, tokens: int) -> None:
        """A request of it ended after decoding `tokens`."""
        if self.first_tokens is not None:
            self.grown_tokens += tokens

    def growth_ended(self) -> int:
        """Its work ended: how much it grew after its first request (counting starts anew)."""
        grown, self.first_tokens, self.grown_tokens = self.grown_tokens, None, 0
        return grown

    def growth_due(self, growths: Sequence[int]) -> float:
        """How much more it is expected to grow, having grown `grown_tokens`: the mean
        residual growth of the programs whose work ended (`growths`): of those that grew more
        than it has, how much more on average; as much again as it grew when none did (a
        program already past every one seen is not about to end). With none ended yet: as much
        as its first request computed, less what it grew. None unless its growth is unknown.

        >>> record = ProgramRecord(0.0)
        >>> record.computed(100, unknown=True); record.decoded(4); record.computed(30)
        >>> record.growth_due([]), record.growth_due([10, 50, 94]), record.growth_due([20])
        (66.0, 38.0, 34.0)
        """
        if self.first_tokens is None or not self.growth_unknown:
            return 0.0
        grown = self.grown_tokens
        if growths:
            more = [g - grown for g in growths if g > grown]
            return sum(more) / len(more) if more else float(grown)
        return max(0.0, float(self.first_tokens - grown))

    def charge(self, branch: str | None, tokens: int) -> None:
        """A request of `branch` starts and computes `tokens` of prompt."""
        branch = branch or TRUNK
        # a branch starts where the branch it forked from stands (a fork's numbers repeat at
        # the next fork), and continues after a join from the longest branch that joined in
        parent, joined = branch.rpartition(".")[0], branch + "."
        here = max([self.path_tokens.get(branch, 0), self.path_tokens.get(parent, 0),
                    *(v for b, v in self.path_tokens.items() if b.startswith(joined))])  # fmt: skip
        self.path_tokens.pop(branch, None)
        self.path_tokens[branch] = here + tokens  # (the most recently charged last)
        if len(self.path_tokens) > MAX_PROGRAM_BRANCHES:
            self.path_tokens.pop(next(iter(self.path_tokens)))
        self.critical_tokens = max(self.critical_tokens, here + tokens)

    def paused(self, branch: str | None, node: TreeNode) -> None:
        """`branch` paused on its tools with its path ending at `node`."""
        branch = branch or TRUNK
        self.paused_nodes.pop(branch, None)
        self.paused_nodes[branch] = node  # (the most recently paused last)
        if len(self.paused_nodes) > MAX_PROGRAM_BRANCHES:
            self.paused_nodes.pop(next(iter(self.paused_nodes)))

    def recomputed(self, branch: str | None, prompt_ids: list[int], cached_tokens: int) -> int:
        """`branch` is back with `prompt_ids` and found `cached_tokens` of them in the pool:
        how many of them it computes again that the path it paused at held (0 if it was not
        paused). Only what the prompt shares with that path counts: a next prompt may extend
        less of it (a reply tokenized again), and the rest was never the pool's to keep."""
        node = self.paused_nodes.pop(branch or TRUNK, None)
        if node is None:
            return 0
        return max(0, path_shares(node, tuple(prompt_ids)) - cached_tokens)


def service_level(critical_tokens: int, quantum_tokens: int) -> int:
    """A program's priority level by attained service, 0 the highest: level k holds services
    of (2^k - 1) to (2^(k+1) - 1) quanta (Autellix's discretized queues). A program in a
    higher level than another displaces it; within a level none does, so two programs of
    about the same service do not take the pool from each other in turns.

    >>> [service_level(t, 100) for t in (0, 99, 100, 299, 300, 700)]
    [0, 0, 1, 1, 2, 3]
    """
    return (critical_tokens // quantum_tokens + 1).bit_length() - 1
