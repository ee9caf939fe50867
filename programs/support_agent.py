"""W1, the support agent: its seeded inputs and its program.

Shape: system prompt S (512 tokens) -> few-shot block F (1,543 tokens) -> a conversation of T
turns per user (user message 80-120 tokens, assistant reply <= 48 tokens). One user in 8 has a
retrieved context R (2,112 tokens, their own) after S instead of F.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flowlang import assistant, gen, program, system
from flowlang import user as user_message
from programs.text import CUSTOMERS, QUESTIONS, TextBuilder, token_counter

SYSTEM_TOKENS, FEWSHOT_TOKENS, RAG_TOKENS = 512, 1543, 2112
USER_TOKENS = (80, 120)
REPLY_TOKENS = 48
SIZES = {"test": (8, 2), "bench": (64, 3)}  # users, turns
RAG_EVERY = 8


@dataclass(frozen=True)
class User:
    name: str
    rag_context: str | None  # None: this user gets the few-shot block
    messages: tuple[str, ...]  # one per turn


@dataclass(frozen=True)
class SupportAgentInputs:
    system_prompt: str
    fewshot: str
    users: tuple[User, ...]
    reply_tokens: int = REPLY_TOKENS

    def system_message(self, user: User) -> str:
        """S then F, or S then the user's retrieved context."""
        tail = user.rag_context if user.rag_context is not None else self.fewshot
        return f"{self.system_prompt}\n\n{tail}"


def first_turn_ids(tokenizer, inputs: SupportAgentInputs) -> list[list[int]]:
    """Every user's first request as chat-templated token ids (for engine-level tests)."""
    return [
        list(
            tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": inputs.system_message(user)},
                    {"role": "user", "content": user.messages[0]},
                ],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for user in inputs.users
    ]


def make_inputs(
    tokenizer, size: str = "test", seed: int = 0, users: int | None = None, turns: int | None = None
) -> SupportAgentInputs:
    """Deterministic W1 inputs; lengths are measured with `tokenizer` (SmolLM2's). `users`
    and `turns` replace the size's (a 1,000-user batch file, say)."""
    num_users, num_turns = SIZES[size]
    num_users, num_turns = users or num_users, turns or num_turns
    count = token_counter(tokenizer)
    text = TextBuilder(seed, count)
    system = "You are the support agent of Northwind Goods. " + text.paragraph(SYSTEM_TOKENS - 12)
    fewshot = _fewshot_block(text, count)
    rng = random.Random(seed + 1)
    users = []
    for i in range(num_users):
        rag = None
        if i % RAG_EVERY == RAG_EVERY - 1:
            rag = "Retrieved notes for this customer: " + text.paragraph(RAG_TOKENS - 8)
        name = f"{CUSTOMERS[i % len(CUSTOMERS)]} {i}"
        messages = []
        for turn in range(num_turns):
            opener = f"Hi, this is {name}." if turn == 0 else "Thanks."
            body = text.paragraph(
                rng.randint(*USER_TOKENS) - count(opener) - 1, templates=QUESTIONS
            )
            messages.append(f"{opener} {body}")
        users.append(User(name=name, rag_context=rag, messages=tuple(messages)))
    return SupportAgentInputs(system, fewshot, tuple(users))


def _fewshot_block(text: TextBuilder, count) -> str:
    """Worked examples of good replies, about FEWSHOT_TOKENS long."""
    examples = []
    block = "Examples of good replies:"
    while count(block) < FEWSHOT_TOKENS - 140:
        question = text.paragraph(70, templates=QUESTIONS)
        answer = text.paragraph(60)
        examples.append(f"Customer: {question}\nAgent: {answer}")
        block = "Examples of good replies:\n\n" + "\n\n".join(examples)
    closing = text.paragraph(FEWSHOT_TOKENS - count(block) - 2)
    return f"{block}\n\n{closing}"


# ---------------------------------------------------------------------- the program


@program
def support_agent(s, inputs: SupportAgentInputs, user: User, temperature: float = 0.0):
    """One customer's conversation: S, then F (or their retrieved notes), then T turns."""
    tail = user.rag_context if user.rag_context is not None else inputs.fewshot
    _converse(s, inputs.system_prompt, tail, user.messages, inputs.reply_tokens, temperature)


@program
def support_conversation(
    s,
    system_prompt: str,
    context: str,
    messages: list[str],
    reply_tokens: int = REPLY_TOKENS,
    temperature: float = 0.0,
):
    """W1's conversation from JSON arguments (a batch file's line): S, then the few-shot block
    or the customer's notes (`context`), then a turn per message."""
    _converse(s, system_prompt, context, messages, reply_tokens, temperature)


def _converse(s, system_prompt, context, messages, reply_tokens, temperature) -> None:
    s += system(system_prompt, "\n\n" + context)  # two segments: S is shared by everyone
    for turn, message in enumerate(messages):
        s += user_message(message)
        s += assistant(gen(f"reply_{turn}", max_new_tokens=reply_tokens, temperature=temperature))


def batch_lines(inputs: SupportAgentInputs, temperature: float = 0.0) -> list[dict]:
    """W1 as batch file lines for `flowlang batch --program programs.support_agent`: one
    support_conversation per user."""
    return [
        {
            "custom_id": f"user-{i}",
            "method": "POST",
            "url": "/v1/flowlang/programs/support_conversation",
            "body": {
                "system_prompt": inputs.system_prompt,
                "context": u.rag_context if u.rag_context is not None else inputs.fewshot,
                "messages": list(u.messages),
                "reply_tokens": inputs.reply_tokens,
                "temperature": temperature,
            },
        }
        for i, u in enumerate(inputs.users)
    ]


def batch_args(inputs: SupportAgentInputs, temperature: float = 0.0) -> list[dict]:
    """run_batch arguments: one program instance per user."""
    return [{"inputs": inputs, "user": u, "temperature": temperature} for u in inputs.users]
