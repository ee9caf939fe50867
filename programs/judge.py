"""W4, branch-solve-merge judge: an answer to judge (~300 tokens), fork(4) with one criterion per
branch (gen <= 48 tokens), join the assessments, then a merged verdict (gen <= 64 tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from flowlang import assistant, gen, program, system, user
from programs.text import QUESTIONS, TextBuilder, token_counter

SIZES = {"test": 2, "bench": 32}
CRITERIA = ("accuracy", "completeness", "clarity", "tone")
ANSWER_TOKENS, ASSESS_TOKENS, VERDICT_TOKENS = 300, 48, 64


@dataclass(frozen=True)
class Case:
    question: str
    answer: str


def make_inputs(tokenizer, size: str = "test", seed: int = 0) -> list[Case]:
    """Deterministic W4 inputs: a question and an agent reply to judge per case."""
    text = TextBuilder(seed + 5, token_counter(tokenizer))
    return [
        Case(text.paragraph(40, templates=QUESTIONS), text.paragraph(ANSWER_TOKENS))
        for _ in range(SIZES[size])
    ]


@program
def judge(s, case: Case, temperature: float = 0.0):
    """One assessment per criterion in forked branches, joined, then a merged verdict."""
    s += system("You grade support replies strictly and briefly.")
    s += user(f"Customer question: {case.question}\n\nAgent reply: {case.answer}")
    branches = s.fork(len(CRITERIA))
    for branch, criterion in zip(branches, CRITERIA, strict=True):
        branch += assistant(
            f"Judging {criterion}: ",
            gen("assessment", max_new_tokens=ASSESS_TOKENS, temperature=temperature),
        )
    s.join(branches, mode="concat")
    s += user("Merge the assessments above into one verdict with a score out of 10.")
    s += assistant(gen("verdict", max_new_tokens=VERDICT_TOKENS, temperature=temperature))
