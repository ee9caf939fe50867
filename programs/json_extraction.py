"""W5, JSON extraction: a document (~300 tokens) and an instruction, then a `gen` constrained by
a pydantic model (7 fields, a bounded list); s["ticket"] is a validated TicketInfo."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from flowlang import assistant, gen, program, system, user
from programs.text import CUSTOMERS, PRODUCTS, TextBuilder, token_counter

SIZES = {"test": 4, "bench": 64}
DOCUMENT_TOKENS = 300
Topic = Literal["shipping", "returns", "warranty", "billing", "repairs", "gift cards"]


class TicketInfo(BaseModel):
    customer_name: str = Field(max_length=40)
    order_number: int = Field(ge=10000, le=99999)
    product: str = Field(max_length=40)
    issue: Literal["damaged", "late", "missing", "billing", "other"]
    urgency: Literal["low", "medium", "high"]
    wants_refund: bool
    topics: list[Topic] = Field(max_length=3)


@dataclass(frozen=True)
class Document:
    text: str
    customer: str  # the facts the text states, for checking extractions
    order_number: int
    product: str


def make_inputs(tokenizer, size: str = "test", seed: int = 0) -> list[Document]:
    """Deterministic W5 inputs: support emails with known facts."""
    text = TextBuilder(seed + 8, token_counter(tokenizer))
    rng = random.Random(seed + 9)
    documents = []
    for _ in range(SIZES[size]):
        name, product = rng.choice(CUSTOMERS), rng.choice(PRODUCTS)
        order = rng.randint(10000, 99999)
        header = (
            f"From: {name}\nSubject: order {order}\n\nHello, my name is {name} and I am "
            f"writing about order {order}, {product}. It arrived damaged and I would like "
            f"a refund as soon as possible. "
        )
        body = text.paragraph(DOCUMENT_TOKENS - text.count_tokens(header))
        documents.append(Document(header + body, name, order, product.removeprefix("the ")))
    return documents


@program
def json_extraction(s, document: Document, temperature: float = 0.0, seed: int | None = None):
    """A support email, then its ticket generated as schema-constrained JSON."""
    s += system("You read support emails and extract the ticket as JSON.")
    s += user(f"{document.text}\n\nExtract the ticket as JSON.")
    s += assistant(
        gen("ticket", schema=TicketInfo, max_new_tokens=256, temperature=temperature, seed=seed)
    )
