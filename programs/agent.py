"""The agent: a ReAct-style loop over three local tools, and a dozen tasks for batches.

Shape: a system prompt that shows the tools (shared by every task) -> the user's task -> up to
`max_steps` rounds of an assistant turn that calls tools (run at once, results appended as tool
messages) -> the first turn that answers in text is the answer. Each gen with tools tells the
engine that the branch pauses for its tools (`latency_s`), so the cache keeps its KV for the
next round.

Tools: `calculator` (arithmetic through `ast`, never eval), `search_documents` (keyword scoring
over a small built-in store), `clock` (the time in a timezone; the clock is injectable).
`make_tools(now=..., latency_scale=1.0)` makes them with a fixed clock and simulated latency
(each sleeps its declared `latency_s`); pass them as the program's `tools`.

    >>> states = agent.run_batch(batch_args(TASKS[:6], max_steps=2))  # doctest: +SKIP
"""

from __future__ import annotations

import ast
import math
import operator
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field

from flowlang import Tool, gen, program, system, tool, user

SYSTEM_PROMPT = (
    "You are a careful assistant with tools. Call a tool when it gives you a fact you need "
    "(arithmetic, the documents, the time); when you know the answer, reply with it in one "
    "short sentence."
)
MAX_STEPS = 3
STEP_TOKENS = 96
LATENCY_S = {"calculator": 0.01, "search_documents": 0.2, "clock": 0.01}  # declared latencies

# the documents search_documents finds: id | title | text, one a line
DOCUMENTS = tuple(
    tuple(field.strip() for field in line.split("|"))
    for line in """
returns | Return policy | Items can be returned within 30 days with the receipt.
shipping | Shipping times | Standard shipping takes 3 to 5 business days.
express | Express shipping | Express orders placed before noon arrive the next day.
warranty | Warranty | Electronics carry a two year warranty against defects.
hours | Store hours | The store opens at 9 and closes at 18, Monday to Saturday.
payment | Payment methods | We accept cards, bank transfer and gift vouchers.
lamp | Lamp flickering | A flickering lamp usually needs a new bulb or a tight socket.
cancel | Cancelling orders | Orders can be cancelled free of charge until they ship.
gift | Gift vouchers | Gift vouchers are valid for one year and cannot be refunded.
loyalty | Loyalty points | Every euro spent earns one point; 100 points give 5 euros.
repair | Repairs | Repairs under warranty are free and take about ten days.
contact | Contact | Support answers emails within one business day.
""".strip().splitlines()
)

TASKS = (
    "What is 17 * 23?",
    "How many days do I have to return an item?",
    "What time is it in Tokyo?",
    "What is (125 + 75) / 8?",
    "How long does standard shipping take?",
    "My lamp flickers. What should I do?",
    "What is 2 ** 10 - 24?",
    "Can I cancel my order after it has shipped?",
    "What time is it in UTC right now?",
    "How many loyalty points do I need for 5 euros?",
    "What is the square root of 144 plus 8?",
    "How long is the warranty on electronics?",
)


# ---------------------------------------------------------------------- the calculator

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would take the machine; bounded powers cannot
MAX_EXPRESSION_CHARS = 200


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, parentheses, pi, e,
    sqrt/abs/round/min/max. Anything else is a ValueError (the tree is walked, never eval'd)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*"), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    return _value(tree.body)


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _FUNCTIONS
        and not node.keywords
    ):
        return _FUNCTIONS[node.func.id](*(_value(a) for a in node.args))
    raise ValueError(f"unsupported in an arithmetic expression: {ast.unparse(node)!r}")


# ---------------------------------------------------------------------- the documents

_WORD = re.compile(r"[a-z0-9]+")
_STOP_WORDS = frozenset(
    "a an and are at be can do does for how i in is it long many my of on the to what when "
    "with".split()
)


def search(query: str, top_k: int = 2) -> list[dict[str, str]]:
    """The `top_k` documents that share the most query words (title words count twice)."""
    words = [w for w in _WORD.findall(query.lower()) if w not in _STOP_WORDS]
    scored = []
    for index, (doc_id, title, text) in enumerate(DOCUMENTS):
        title_words, text_words = _WORD.findall(title.lower()), _WORD.findall(text.lower())
        score = sum(2 * title_words.count(w) + text_words.count(w) for w in words)
        if score > 0:
            scored.append((-score, index, {"id": doc_id, "title": title, "text": text}))
    return [doc for _, _, doc in sorted(scored)[:top_k]]


# ---------------------------------------------------------------------- the tools


def make_tools(
    now: Callable[[], datetime] | None = None, latency_scale: float = 0.0
) -> tuple[Tool, ...]:
    """The agent's tools. `now` gives the current UTC time (default: the system clock);
    each tool sleeps `latency_scale` x its declared latency (0: no sleep) to simulate a
    remote call."""
    now = now or (lambda: datetime.now(UTC))

    def pause(name: str) -> None:
        if latency_scale > 0:
            time.sleep(LATENCY_S[name] * latency_scale)

    @tool(latency_s=LATENCY_S["calculator"])
    def calculator(
        expression: Annotated[str, Field(description="e.g. (3 + 4) * 2", max_length=40)],
    ) -> int | float:
        """Evaluate an arithmetic expression (+ - * / ** and parentheses, sqrt, pi)."""
        pause("calculator")
        return evaluate(expression)

    @tool(latency_s=LATENCY_S["search_documents"])
    def search_documents(
        query: Annotated[str, Field(description="keywords to look for", max_length=60)],
        top_k: Annotated[int, Field(ge=1, le=5)] = 2,
    ) -> list[dict[str, str]]:
        """Search the shop's help documents; the best matches first."""
        pause("search_documents")
        return search(query, top_k)

    @tool(latency_s=LATENCY_S["clock"])
    def clock(
        timezone: Annotated[
            str, Field(description="an IANA name such as Asia/Tokyo", max_length=40)
        ] = "UTC",
    ) -> str:
        """The current date and time in a timezone."""
        pause("clock")
        try:
            zone = ZoneInfo(timezone)
        except (ZoneInfoNotFoundError, ValueError) as err:
            raise ValueError(f"unknown timezone {timezone!r}; use an IANA name") from err
        return now().astimezone(zone).isoformat(timespec="minutes")

    return (calculator, search_documents, clock)


TOOLS = make_tools()


# ---------------------------------------------------------------------- the program


@program
def agent(
    s,
    task: str,
    max_steps: int = MAX_STEPS,
    first_tool_choice: str = "required",
    tool_choice: str = "auto",
    max_new_tokens: int = STEP_TOKENS,
    temperature: float = 0.0,
    tools: tuple[Tool, ...] = TOOLS,
):
    """Answer `task` with up to `max_steps` rounds of tool calls. The first round uses
    `first_tool_choice` (default "required": look something up first), later ones
    `tool_choice`; s["answer"] is the first text reply (after the rounds: one without tools);
    s["steps"] lists each round's (tool name, arguments, result) triples."""
    s += system(SYSTEM_PROMPT, tools=tools)
    s += user(task)
    steps: list[list[tuple[str, dict, Any]]] = []
    for step in range(max_steps):
        with s.assistant():
            s += gen(
                "step",
                tools=tools,
                tool_choice=first_tool_choice if step == 0 else tool_choice,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
            )
        calls = s["step"]
        if isinstance(calls, str):  # a text reply: the answer
            s["steps"] = steps
            s["answer"] = calls.strip()
            return
        results = s.run_tools(calls)
        steps.append([(c.name, c.arguments, r) for c, r in zip(calls, results, strict=True)])
    s["steps"] = steps
    with s.assistant():  # out of rounds: answer from what the tools said
        s += gen(
            "final",
            tools=tools,
            tool_choice="none",
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
    s["answer"] = s["final"].strip()


def batch_args(tasks: tuple[str, ...] = TASKS, **options: Any) -> list[dict[str, Any]]:
    """run_batch arguments: one agent instance per task (`options`: the program's)."""
    return [{"task": task, **options} for task in tasks]
