"""W2, few-shot multiple choice (MMLU-like): per subject a 5-shot block (~600 tokens), then a
question (~60 tokens) and a `select` among " A", " B", " C", " D"."""

from __future__ import annotations

import random
from dataclasses import dataclass

from flowlang import fewshot, program, select
from programs.text import PRODUCTS, TOPICS, TextBuilder, token_counter

SUBJECTS = [
    "store policy",
    "product care",
    "logistics",
    "customer law",
    "accounting",
    "safety rules",
]
LETTERS = ("A", "B", "C", "D")
SIZES = {"test": (2, 4), "bench": (4, 32)}  # subjects, questions per subject
SHOTS = 5
SHOT_TOKENS, QUESTION_TOKENS = 118, 60

FEWSHOT_TEMPLATE = (
    "The following are multiple choice questions (with answers) about {{ subject }}.\n\n"
    "{% for e in examples %}{{ e.question }}\n"
    "{% for option in e.options %}{{ 'ABCD'[loop.index0] }}. {{ option }}\n{% endfor %}"
    "Answer: {{ e.answer }}\n\n{% endfor %}"
)


@dataclass(frozen=True)
class Question:
    text: str
    options: tuple[str, str, str, str]
    answer: str  # "A".."D"


@dataclass(frozen=True)
class Subject:
    name: str
    shots: tuple[Question, ...]
    questions: tuple[Question, ...]


def make_inputs(tokenizer, size: str = "test", seed: int = 0) -> tuple[Subject, ...]:
    """Deterministic W2 inputs: subjects with their shots and questions."""
    num_subjects, num_questions = SIZES[size]
    count = token_counter(tokenizer)
    text = TextBuilder(seed + 2, count)
    rng = random.Random(seed + 3)

    def question(tokens: int) -> Question:
        options = tuple(
            f"{rng.choice(['Offer', 'Refuse', 'Escalate', 'Document'])} "
            f"{rng.choice(PRODUCTS)} for {rng.choice(TOPICS)}"
            for _ in range(4)
        )
        stem = text.paragraph(max(8, tokens - sum(count(o) + 3 for o in options) - 6))
        return Question(f"Question: {stem}", options, rng.choice(LETTERS))

    return tuple(
        Subject(
            SUBJECTS[i],
            tuple(question(SHOT_TOKENS) for _ in range(SHOTS)),
            tuple(question(QUESTION_TOKENS) for _ in range(num_questions)),
        )
        for i in range(num_subjects)
    )


@program
def fewshot_choice(
    s, subject: Subject, question: Question, method: str = "token_length_normalized"
):
    """The subject's few-shot block, the question, then a select of the answer letter."""
    s += fewshot(
        FEWSHOT_TEMPLATE,
        [{"question": q.text, "options": q.options, "answer": q.answer} for q in subject.shots],
        subject=subject.name,
    )
    s += question.text + "\n"
    s += "".join(
        f"{letter}. {option}\n" for letter, option in zip(LETTERS, question.options, strict=True)
    )
    s += "Answer:"
    s += select("answer", choices=[f" {letter}" for letter in LETTERS], method=method)


def batch_args(subjects: tuple[Subject, ...]) -> list[dict]:
    return [{"subject": subj, "question": q} for subj in subjects for q in subj.questions]
