"""W6, multi-turn chat: its seeded inputs and its program.

Shape: a shared system prompt (~200 tokens) -> 4 turns per conversation; user messages of
30-60 tokens; each turn's assistant `gen` <= 64 tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flowlang import assistant, gen, program, system, user
from programs.text import CHAT_QUESTIONS, TextBuilder, token_counter

SYSTEM_TOKENS = 200
USER_TOKENS = (30, 60)
REPLY_TOKENS = 64
SIZES = {"test": (4, 4), "bench": (32, 4)}  # conversations, turns


@dataclass(frozen=True)
class MultiTurnInputs:
    system_prompt: str
    conversations: tuple[tuple[str, ...], ...]  # user messages, one per turn
    reply_tokens: int = REPLY_TOKENS


def make_inputs(tokenizer, size: str = "test", seed: int = 0) -> MultiTurnInputs:
    """Deterministic W6 inputs: one system prompt and every conversation's user messages."""
    num_convs, num_turns = SIZES[size]
    count = token_counter(tokenizer)
    text = TextBuilder(seed + 6, count)
    system = "You are a patient tutor who answers briefly. " + text.paragraph(SYSTEM_TOKENS - 10)
    rng = random.Random(seed + 7)
    conversations = tuple(
        tuple(
            text.paragraph(rng.randint(*USER_TOKENS), templates=CHAT_QUESTIONS)
            for _ in range(num_turns)
        )
        for _ in range(num_convs)
    )
    return MultiTurnInputs(system, conversations)


# ---------------------------------------------------------------------- the program


@program
def multi_turn_chat(
    s,
    system_prompt: str,
    messages: tuple[str, ...],
    reply_tokens: int = REPLY_TOKENS,
    temperature: float = 0.0,
):
    """The system prompt, then one user message and one generated reply per turn."""
    s += system(system_prompt)
    for turn, message in enumerate(messages):
        s += user(message)
        s += assistant(gen(f"reply_{turn}", max_new_tokens=reply_tokens, temperature=temperature))


def batch_args(inputs: MultiTurnInputs, temperature: float = 0.0) -> list[dict]:
    """run_batch arguments: one program instance per conversation."""
    return [
        {
            "system_prompt": inputs.system_prompt,
            "messages": msgs,
            "reply_tokens": inputs.reply_tokens,
            "temperature": temperature,
        }
        for msgs in inputs.conversations
    ]
