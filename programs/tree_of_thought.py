"""W3, tree of thought: a question, then fork(3) at each of 3 levels (3 + 9 + 27 = 39 gens of
at most 32 tokens), then a `select` of the best leaf."""

from __future__ import annotations

from flowlang import gen, program, select
from programs.text import TextBuilder, token_counter

SIZES = {"test": 2, "bench": 16}  # questions
DEPTH, WIDTH, THOUGHT_TOKENS = 3, 3, 32

PUZZLES = [
    "A customer ordered {product} and says it {verb}; how should we respond about {topic}?",
    "Plan the steps to resolve a complaint about {topic} for {product}.",
    "Which policy applies when {product} {verb} during {topic}?",
]


def make_inputs(tokenizer, size: str = "test", seed: int = 0) -> list[str]:
    """Deterministic W3 inputs: one problem statement per question."""
    text = TextBuilder(seed + 4, token_counter(tokenizer))
    return [
        f"Problem: {text.fill(PUZZLES[i % len(PUZZLES)])} {text.paragraph(40)}"
        for i in range(SIZES[size])
    ]


@program
def tree_of_thought(s, question: str, temperature: float = 0.0):
    """Three levels of three-way forks of thoughts, then a select of the best leaf."""
    s += question + "\nLet us think in steps."
    leaves = [s]
    for depth in range(DEPTH):
        next_leaves = []
        for leaf in leaves:
            for i, branch in enumerate(leaf.fork(WIDTH)):
                branch += f"\nStep {depth + 1}, idea {i + 1}:"
                branch += gen("thought", max_new_tokens=THOUGHT_TOKENS, temperature=temperature)
                next_leaves.append(branch)
        leaves = next_leaves
    s += "\n\nCandidate final ideas:\n"
    s += "".join(f"{i + 1}.{leaf['thought']}\n" for i, leaf in enumerate(leaves))
    s += "The most promising candidate is number"
    s += select("best", choices=[f" {i + 1}" for i in range(len(leaves))])
