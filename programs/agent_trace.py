"""W7 replayed: one agent of a generated agent trace as a flowlang program.

A trace (examples/benchmarks/agent_traces.py draws them) fixes every length and every wait;
this program replays one agent of it so that a batch reaches the engine as agents do: a system
prompt with typed tools that every agent shares (run_batch pins it) -> the agent's private
context -> rounds of an assistant turn that must call a tool (a gen with `tools=`, so the
request carries the program, its branch and the tools' declared latency) -> the round's tool
results, returned after the trace's gap -> a final answer. At one round some agents fork
subagents that share everything so far, each with its own task and rounds; the parent joins
them, reads their reports and goes on.

Deterministic by construction: text is drawn from WORDS (each one SmolLM2 token, so n words are
n tokens), every gen is greedy with ignore_eos and the trace's max_new_tokens, and the calls
run are the trace's (the model's own call only fills the assistant turn), so a batch sends
the same requests under every eviction policy and pool size. The turn's gen offers the tools
with tool_choice "auto": the engine sees a branch paused on its tools (the slowest tool's
declared latency as its hint), and no model fails the replay, where "required" is an error
when a random model's call (it pads JSON with whitespace) runs past max_new_tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated

import pydantic
from pydantic import Field

from flowlang import Tool, gen, program, system, tool, user

# each is one token with its leading space in SmolLM2's tokenizer (tests/test_agent_traces.py)
WORDS = tuple(
    "the file test code build error line value module function class return import data list "
    "path config result check run fix change update small large first next last new old input "
    "output cache page token read write open close start stop time user name type field call "
    "tool step plan note task bug patch branch commit merge review log trace stack frame loop "
    "table query index server client request response state event queue thread lock node tree "
    "leaf root key map set array string number count size limit range order sort filter match "
    "search".split()
)
GREEDY = {"temperature": 0.0, "ignore_eos": True}  # outputs of the trace's lengths, repeatable


def words_text(num_tokens: int, key: str) -> str:
    """`num_tokens` words of WORDS, seeded by `key` (a str seeds the same on every run)."""
    rng = random.Random(key)
    return " ".join(rng.choice(WORDS) for _ in range(num_tokens))


# ---------------------------------------------------------------------- what a trace holds


@dataclass(frozen=True)
class ToolCallTrace:
    tool: str  # one of TOOL_NAMES
    argument: str  # the value of the tool's one argument
    result_tokens: int  # the result the model reads
    gap_s: float  # how long the tool takes, before the batch's time_scale


@dataclass(frozen=True)
class RoundTrace:
    assistant_tokens: int  # the assistant turn's max_new_tokens
    calls: tuple[ToolCallTrace, ...]  # run at once; more than one: parallel calls

    @property
    def gap_s(self) -> float:
        return max(c.gap_s for c in self.calls)


@dataclass(frozen=True)
class SubagentTrace:
    task_tokens: int  # its own task, after the parent's prefix
    rounds: tuple[RoundTrace, ...]
    report_tokens: int  # what it reports back to the parent


@dataclass(frozen=True)
class AgentTrace:
    key: str  # seeds the agent's text (distinct per agent)
    context_tokens: int  # the private task context
    rounds: tuple[RoundTrace, ...]
    answer_tokens: int
    fork_after_round: int | None = None  # the round after whose results subagents start
    subagents: tuple[SubagentTrace, ...] = ()
    arrival_s: float = 0.0  # when it starts, after the batch does (wall seconds)


# ---------------------------------------------------------------------- the tools


@dataclass(frozen=True)
class ToolDeclaration:
    """One replayed tool: its one string argument, what it says, what latency it declares."""

    argument: str
    argument_description: str
    description: str
    latency_s: float  # before time_scale: the middle of its gap bucket (agent_traces.py)

    def arguments_model(self, name: str) -> type[pydantic.BaseModel]:
        """The tool's arguments as a pydantic model (named and described as the tool)."""
        hint = Annotated[str, Field(description=self.argument_description, max_length=48)]
        return pydantic.create_model(
            name,
            __config__=pydantic.ConfigDict(extra="forbid"),
            __doc__=self.description,
            **{self.argument: (hint, ...)},
        )


TOOL_DECLARATIONS = {
    "read_file": ToolDeclaration(
        "path", "a repository path", "Read a file of the repository.", 0.2
    ),
    "search_code": ToolDeclaration(
        "query", "words to find", "Search the repository's code; the matching lines first.", 0.2
    ),
    "edit_file": ToolDeclaration(
        "path", "a repository path", "Apply the planned edit to a file; the diff comes back.", 0.2
    ),
    "run_command": ToolDeclaration(
        "command", "a command", "Run a shell command in the repository; its output comes back.", 3.0
    ),
    "run_tests": ToolDeclaration(
        "target", "a test path", "Run the tests under a path; the failures come back.", 25.0
    ),
}
TOOL_NAMES = tuple(TOOL_DECLARATIONS)


@functools.cache
def make_tools(time_scale: float = 1.0) -> dict[str, Tool]:
    """The agents' typed tools by name, each declaring its latency x `time_scale` (the
    trace's replay gives each call's result: `replayed`)."""
    return {
        name: tool(declared.arguments_model(name), latency_s=declared.latency_s * time_scale)
        for name, declared in TOOL_DECLARATIONS.items()
    }


def replayed(made: Tool, gap_s: float, text: str) -> Tool:
    """`made` as the trace runs it: sleeps `gap_s`, then returns `text` (a function tool now:
    a call runs `run`, where the model tool's call would give its arguments)."""

    def run(**_arguments: str) -> str:
        time.sleep(gap_s)
        return text

    return dataclasses.replace(made, fn=run, is_model=False)


# ---------------------------------------------------------------------- the program


def replay_round(s, round_: RoundTrace, time_scale: float, key: str) -> None:
    """One round: an assistant turn offered the tools, then the trace's calls' results."""
    tools = make_tools(time_scale)
    with s.assistant():
        s += gen(
            "step",
            tools=list(tools.values()),
            tool_choice="auto",  # "required" fails a call cut at max_new_tokens; the trace
            # decides the calls, so any model replays every trace (see the module's docstring)
            parallel_tool_calls=len(round_.calls) > 1,
            max_new_tokens=round_.assistant_tokens,
            **GREEDY,
        )
    calls = []
    for i, c in enumerate(round_.calls):
        made = tools[c.tool]
        (argument,) = made.parameters["properties"]
        text = words_text(c.result_tokens, f"{key}:call{i}")
        calls.append(
            replayed(made, c.gap_s * time_scale, text).call({argument: c.argument}, f"call_{i}")
        )
    s.run_tools(calls)  # at once, on the language's thread pool


def replay_subagents(s, trace: AgentTrace, time_scale: float) -> None:
    """Fork one branch per subagent, run each on a thread of its own (a branch's rounds wait
    on its tools, and the subagents wait at once), join, and read their reports."""
    branches = s.fork(len(trace.subagents))

    def subagent(index: int) -> None:
        branch, sub = branches[index], trace.subagents[index]
        key = f"{trace.key}:sub{index}"
        branch += user(words_text(sub.task_tokens, f"{key}:task"))
        for number, round_ in enumerate(sub.rounds):
            replay_round(branch, round_, time_scale, f"{key}:r{number}")
        with branch.assistant():
            branch += gen("report", max_new_tokens=sub.report_tokens, **GREEDY)

    with ThreadPoolExecutor(len(branches), "subagent") as pool:
        list(pool.map(subagent, range(len(branches))))
    s.join(branches)
    s += user("Subagent reports:\n" + "\n".join(s["report"]))


@program
def agent_trace(s, trace: AgentTrace, system_prompt: str, time_scale: float = 1.0):
    """Replay `trace` after the shared `system_prompt`; tools wait their gaps x `time_scale`.
    s["answer"] is the final answer; s["arrived_s"] and s["finished_s"] the perf_counter when
    it started (after its arrival_s) and when the answer was back."""
    if trace.arrival_s:  # (a read ends run_batch's compile here: only a run waits; no pins)
        s["arrival_s"] = trace.arrival_s
        time.sleep(s["arrival_s"])
    s["arrived_s"] = time.perf_counter()
    s += system(system_prompt, tools=list(make_tools(time_scale).values()))
    s += user(words_text(trace.context_tokens, f"{trace.key}:context"))
    for number, round_ in enumerate(trace.rounds):
        replay_round(s, round_, time_scale, f"{trace.key}:r{number}")
        if number == trace.fork_after_round and trace.subagents:
            replay_subagents(s, trace, time_scale)
    with s.assistant():
        s += gen("answer", max_new_tokens=trace.answer_tokens, **GREEDY)
    s.sync()  # the answer is back: the time below is the program's completion
    s["finished_s"] = time.perf_counter()
