"""A batch file's input lines (the OpenAI Batch API's JSONL: `custom_id`, `method`, `url`, `body`)
read and checked one by one: a bad line becomes that line's error, never the file's.

Each line has a stable id, `batch_req_` + a digest of its custom_id and body (its raw text when it
is not a valid line): a rerun over the same input and results recognises what is done by
(custom_id, id), so an edited body under the same custom_id runs again."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_LINE_BYTES = 8 << 20  # one request's body; a bigger line is that line's error
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    """One valid input line: what to run (url, body) and under which ids it is reported."""

    number: int  # 1-based line number in the input file
    custom_id: str
    url: str
    body: dict[str, Any]
    id: str  # batch_req_<digest of custom_id and body>

    @property
    def key(self) -> tuple[str | None, str]:
        return self.custom_id, self.id


@dataclass(frozen=True)
class BadLine:
    """A line that cannot run: its error is reported under whatever custom_id it had."""

    number: int
    custom_id: str | None
    id: str
    message: str
    code: str = "invalid_line"

    @property
    def key(self) -> tuple[str | None, str]:
        return self.custom_id, self.id


@dataclass
class ParsedFile:
    lines: list[BatchLine] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.lines) + len(self.bad)


def line_id(text: str) -> str:
    return "batch_req_" + hashlib.sha256(text.encode()).hexdigest()[:24]


def canonical(value: Any) -> str:
    """The JSON text a digest is taken of: key order and spacing do not change it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_lines(raw_lines: Iterable[bytes | str], urls: Sequence[str]) -> ParsedFile:
    """Every non-blank line of a batch file, checked: JSON object, a unique non-empty string
    custom_id, method POST, a url among `urls`, an object body without `stream`."""
    parsed = ParsedFile()
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, start=1):
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        if not text.strip():
            continue
        line = _parse_line(number, text, urls, seen)
        (parsed.lines if isinstance(line, BatchLine) else parsed.bad).append(line)
    return parsed


def _parse_line(number: int, text: str, urls: Sequence[str], seen: dict[str, int]):
    def bad(message: str, custom_id: str | None = None) -> BadLine:
        return BadLine(number, custom_id, line_id(f"{number}:{text}"), f"line {number}: {message}")

    if len(text.encode()) > MAX_LINE_BYTES:
        return bad(f"longer than {MAX_LINE_BYTES} bytes")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return bad(f"not JSON ({err.msg} at column {err.colno})")
    if not isinstance(obj, dict):
        return bad("not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return bad(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    problem = _line_problem(obj, urls)
    if problem is None and custom_id in seen:
        problem = f"custom_id {custom_id!r} repeats line {seen[custom_id]}"
    if problem is not None:
        return bad(problem, custom_id)
    seen[custom_id] = number
    body = obj["body"]
    digest = line_id(canonical([custom_id, obj["url"], body]))
    return BatchLine(number, custom_id, obj["url"], body, digest)


def _line_problem(obj: dict, urls: Sequence[str]) -> str | None:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        return f"unknown field(s) {', '.join(map(repr, unknown))}"
    if obj.get("method") != "POST":
        return f"method must be 'POST', not {obj.get('method')!r}"
    if obj.get("url") not in urls:
        return f"url {obj.get('url')!r} is not one of {', '.join(urls)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    if body.get("stream"):
        return "body.stream: a batch line is answered whole, not streamed"
    return None
