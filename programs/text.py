"""Seeded natural-English text of a given token length, built from templates (no downloads).

Lengths are measured with the tokenizer passed in (the workloads are specified in SmolLM2
tokens), so a paragraph lands within a few tokens of its target.
"""

from __future__ import annotations

import random
from collections.abc import Callable

PRODUCTS = [
    "the Aurora kettle",
    "the Summit backpack",
    "the Breeze fan",
    "the Harbor lamp",
    "the Nimbus blender",
    "the Trail boots",
    "the Echo speaker",
    "the Orbit watch",
    "the Meadow tent",
    "the Quartz scale",
    "the Willow chair",
    "the Falcon drone",
]
TOPICS = [
    "shipping",
    "returns",
    "warranty",
    "billing",
    "account security",
    "repairs",
    "gift cards",
    "loyalty points",
    "international orders",
    "product care",
]
CUSTOMERS = [
    "Maya",
    "Tom",
    "Priya",
    "Lucas",
    "Aiko",
    "Omar",
    "Elena",
    "Sam",
    "Noah",
    "Zara",
    "Iris",
    "Felix",
    "Grace",
    "Hugo",
    "Lena",
    "Ravi",
]
ADJECTIVES = ["careful", "friendly", "patient", "clear", "honest", "quick", "thorough", "calm"]
VERBS = [
    "arrived",
    "stopped working",
    "was damaged",
    "made a strange noise",
    "never shipped",
    "was charged twice",
    "lost its settings",
    "came without a manual",
]

SENTENCES = [
    "Customers who ask about {topic} should get a {adj} answer that names the next step.",
    "When {product} {verb}, apologise once and then explain what we will do about it.",
    "Our policy on {topic} allows a refund or a replacement within thirty days of delivery.",
    "Always confirm the order number before you discuss {topic} with a customer.",
    "If a customer mentions {product}, check whether it is covered by the two year warranty.",
    "Keep every reply short, {adj} and free of internal jargon.",
    "Escalate to a human agent when a question about {topic} involves a legal complaint.",
    "Never promise a delivery date that the warehouse has not confirmed.",
    "For {topic}, the help centre article explains the usual steps in plain language.",
    "A {adj} tone matters most when {product} {verb} right before a holiday.",
    "Offer store credit only after the customer has declined a refund for {product}.",
    "The warehouse in Rotterdam handles {topic} for customers in Europe.",
    "Most questions about {topic} can be solved in a single reply if you ask for a photo.",
    "Summarise what the customer said about {product} before you propose a fix.",
]
QUESTIONS = [
    "I ordered {product} last week and it {verb}.",
    "My partner bought {product} for me and it {verb}.",
    "Can you tell me how {topic} works for my order?",
    "I already wrote to you twice about {topic} and nobody answered.",
    "Would {product} still be covered if I bought it as a gift for a friend?",
    "What should I do next, and how long will it take?",
    "I would prefer a replacement over a refund if that is possible.",
    "The tracking page has not changed for four days now.",
    "Could you also check whether my loyalty points were added?",
    "I live abroad, so please tell me if {topic} is different for me.",
]


CHAT_QUESTIONS = [
    "What is a good way to learn {topic} as a beginner?",
    "Could you explain that again with a simple example about {product}?",
    "Why does {product} matter for people who care about {topic}?",
    "Can you give me three short tips I can use this week?",
    "How would a {adj} teacher describe this to a child?",
    "What mistakes do people usually make at the start?",
    "Please summarise what we discussed in two sentences.",
    "Is there anything I should read next about {topic}?",
]


class TextBuilder:
    """Paragraphs of seeded template sentences, trimmed to a token target."""

    def __init__(self, seed: int, count_tokens: Callable[[str], int]) -> None:
        self.rng = random.Random(seed)
        self.count_tokens = count_tokens

    def fill(self, template: str) -> str:
        """`template` with a seeded topic, product, adjective, verb and name."""
        r = self.rng
        return template.format(
            topic=r.choice(TOPICS),
            product=r.choice(PRODUCTS),
            adj=r.choice(ADJECTIVES),
            verb=r.choice(VERBS),
            name=r.choice(CUSTOMERS),
        )

    def paragraph(self, target_tokens: int, templates: list[str] = SENTENCES) -> str:
        """About `target_tokens` tokens (within 2%, never more than 3 over) of English text."""
        sentences: list[str] = []
        while self.count_tokens(" ".join(sentences)) < target_tokens:
            sentences.append(self.fill(self.rng.choice(templates)))
        words = " ".join(sentences).split(" ")
        while self.count_tokens(" ".join(words)) > target_tokens + 3 and len(words) > 1:
            words.pop()
        text = " ".join(words).rstrip(",;")
        return text if text.endswith((".", "?", "!")) else text + "."


def token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
