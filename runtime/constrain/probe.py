"""A trial compile of each new constraint in a child process that has a memory limit.

xgrammar compiles in C++ and cannot be interrupted or limited from Python: a regex of a few
kilobytes can take gigabytes and minutes (`((a|b)*c{1}|...|(a|b)*c{5000})`). So a constraint
is first compiled here, in a child process whose address space is capped (RLIMIT_AS) and
which is killed when it runs past its time budget. The child sends back the compiled grammar's
size and, when the grammar is small (KEEP_GRAMMAR_BYTES), the grammar itself, serialized: the
server keeps it and compiles nothing. A larger one is compiled again in the server's process
(xgrammar's serialized form can be 60x its size in memory, and take longer than compiling).

The child is `python -m runtime.constrain.probe MEMORY_LIMIT_BYTES`: it reads the
tokenizer info (one JSON line on its stdin), says "ready", then answers each constraint (one
JSON line) with a verdict (one JSON line on its stdout).
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from runtime.protocol import Constraint


@dataclass(frozen=True)
class ProbeVerdict:
    """How a trial compile ended: "ok" (with the compiled size), "invalid" (the compiler's
    message), "memory" (past the memory limit), "time" (past the time budget) or "crashed"
    (the compiler died otherwise)."""

    outcome: str
    detail: str = ""
    num_bytes: int = 0
    grammar: str = ""  # "ok" and small: the compiled grammar, serialized (xgrammar's JSON)


def compile_constraint(compiler: Any, constraint: Constraint) -> Any:
    """`constraint` compiled by an xgrammar GrammarCompiler."""
    if constraint.regex is not None:
        return compiler.compile_regex(constraint.regex)
    if constraint.json_schema is not None:
        return compiler.compile_json_schema(
            json.dumps(constraint.json_schema), any_whitespace=False, separators=(",", ":")
        )
    if constraint.structural_tag is not None:
        return compiler.compile_structural_tag(json.dumps(constraint.structural_tag))
    if constraint.choices is not None:
        alternatives = " | ".join(json.dumps(c) for c in constraint.choices)
        return compiler.compile_grammar(f"root ::= {alternatives}")
    return compiler.compile_grammar(constraint.grammar)


class GrammarProbe:
    """One child process, started on first use and again after it was killed; one trial at a
    time (a caller waits for the one before it)."""

    def __init__(self, tokenizer_info_json: str, memory_limit_bytes: int) -> None:
        self.tokenizer_info_json = tokenizer_info_json.replace("\n", " ")  # one line
        self.memory_limit_bytes = memory_limit_bytes
        self._child: subprocess.Popen | None = None
        self._handover: threading.Thread | None = None
        self._child_ready = False  # it said "ready": its imports are done
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now (its imports take seconds), so the first trial waits less."""
        with self._lock:
            self._started()

    def trial(self, constraint: Constraint, budget_s: float) -> ProbeVerdict:
        """Compile `constraint` in the child within `budget_s` seconds and the memory limit."""
        with self._lock:
            child = self._ready_child()
            child.stdin.write(constraint.model_dump_json() + "\n")
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], budget_s)
            if not ready:
                self._restart()
                return ProbeVerdict("time")
            line = child.stdout.readline()
            verdict = ProbeVerdict(**json.loads(line)) if line else _death(child.wait())
            if verdict.outcome not in ("ok", "invalid"):
                self._restart()  # a fresh heap for the next trial
            return verdict

    def close(self) -> None:
        """Stop the child process."""
        with self._lock:
            self._kill()

    def _started(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._child_ready = False
            self._child = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.memory_limit_bytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            # from a thread: megabytes into a pipe block until the child finished its imports
            self._handover = threading.Thread(
                target=_hand_over, args=(self._child.stdin, self.tokenizer_info_json)
            )
            self._handover.start()
        return self._child

    def _ready_child(self) -> subprocess.Popen:
        """The child, once it has said it is ready (its imports do not count against a
        trial's budget)."""
        child = self._started()
        if not self._child_ready:
            self._handover.join()
            if child.stdout.readline() != "ready\n":
                raise RuntimeError(f"the grammar probe did not start (exit status {child.wait()})")
            self._child_ready = True
        return child

    def _restart(self) -> None:
        self._kill()
        self._started()  # now: its imports overlap whatever comes before the next trial

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def _hand_over(pipe: Any, tokenizer_info_json: str) -> None:
    try:
        pipe.write(tokenizer_info_json + "\n")
        pipe.flush()
    except BrokenPipeError:
        return  # the child was killed meanwhile: the next trial finds it dead and restarts it


def _death(returncode: int) -> ProbeVerdict:
    """Why the child died mid-trial: C++ aborts (SIGABRT) when an allocation fails past the
    limit; anything else (a stack overflow, say) crashed the compiler."""
    if returncode in (-signal.SIGABRT, -signal.SIGKILL):
        return ProbeVerdict("memory")
    return ProbeVerdict("crashed", f"exit status {returncode}")


KEEP_GRAMMAR_BYTES = 512 << 10  # a compiled grammar this small is sent back, serialized
MAX_SENT_CHARS = 4 << 20  # ... unless its serialized form is longer (parsed holding the GIL)
CHILD_NICENESS = 10  # trials are background work: a slow one must not slow everyone's steps


def _serve(memory_limit_bytes: int) -> None:
    """The child: read the tokenizer info, cap the address space, then answer trials."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's; it closes stdin
    os.nice(CHILD_NICENESS)  # its imports included: on a busy machine the engine's step first
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(sys.stdin.readline())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _limit_address_space(memory_limit_bytes)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        verdict = _verdict(compiler, Constraint.model_validate_json(line))
        sys.stdout.write(json.dumps(verdict) + "\n")
        sys.stdout.flush()


def _verdict(compiler: Any, constraint: Constraint) -> dict:
    try:
        compiled = compile_constraint(compiler, constraint)
    except MemoryError:
        return {"outcome": "memory"}
    except (RuntimeError, ValueError, TypeError) as err:
        message = str(err).strip()
        if "bad_alloc" in message:  # C++'s MemoryError, passed on as a RuntimeError
            return {"outcome": "memory"}
        return {"outcome": "invalid", "detail": message.splitlines()[0] if message else ""}
    num_bytes = int(compiled.memory_size_bytes)
    return {"outcome": "ok", "num_bytes": num_bytes, "grammar": _serialized(compiled, num_bytes)}


def _serialized(compiled: Any, num_bytes: int) -> str:
    """The grammar as xgrammar serializes it when it is small enough to send; else ""."""
    if num_bytes > KEEP_GRAMMAR_BYTES:
        return ""
    try:
        text = compiled.serialize_json()
    except (MemoryError, RuntimeError):  # past the memory limit: the server compiles it
        return ""
    return text if len(text) <= MAX_SENT_CHARS else ""


def _limit_address_space(extra_bytes: int) -> None:
    """Allow `extra_bytes` of address space beyond what the imports already mapped."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
