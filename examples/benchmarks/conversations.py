"""Multi-turn conversations advanced in rounds, as token ids (no flowlang import: peer engines'
venvs load this too).

Turn 0 comes from the chat template; turn t+1 extends turn t's prompt with its generated ids
(closed by <|im_end|>) and the next user message, so the KV computed while decoding is reusable.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Conversation:
    system: str
    user_messages: list[str]
    reply_tokens: int

    def to_json(self) -> dict:
        return asdict(self)


def next_prompt(
    tokenizer,
    conv: Conversation,
    turn: int,
    prev_prompt: list[int] | None,
    prev_output: list[int] | None,
) -> list[int]:
    """Turn 0 from the chat template; later turns extend the previous ids exactly."""
    if turn == 0:
        return list(
            tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": conv.system},
                    {"role": "user", "content": conv.user_messages[0]},
                ],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    reply = prev_output if prev_output and prev_output[-1] == end else [*prev_output, end]
    joiner = f"\n<|im_start|>user\n{conv.user_messages[turn]}<|im_end|>\n<|im_start|>assistant\n"
    return [*prev_prompt, *reply, *tokenizer.encode(joiner, add_special_tokens=False)]
