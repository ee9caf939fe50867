"""A batch's results file (output or errors: JSONL, one result a line), durable line by line.

Each result is one `write` of one whole line to a file opened for appending, then fsynced: a
crash (SIGKILL, power) leaves every finished line whole and at most a torn last line, which the
next open cuts off. Reopened, the file says which lines are done — by (custom_id, id), see
lines.py — so a rerun over the same input skips them and appends nothing twice."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from runtime.errors import UsageError


class ResultsFileError(UsageError):
    """A results file that is not one this runner wrote (a line that is not a result)."""


class ResultsFile:
    """Appends result lines to `path` (created if missing) and knows the ones it holds."""

    def __init__(self, path: str | os.PathLike, sync: bool = True) -> None:
        self.path = Path(path)
        self.sync = sync  # fsync each line (off only for a scratch file)
        self._lock = threading.Lock()
        self.done: set[tuple[str | None, str]] = set()
        self.records = 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._read_back()
        except BaseException:
            os.close(self._fd)
            raise

    def _read_back(self) -> None:
        """Cut a torn last line off, then read every whole line's key."""
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            os.ftruncate(self._fd, whole)
        for number, line in enumerate(data[:whole].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = (record["custom_id"], record["id"])
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ResultsFileError(
                    f"{self.path}: line {number} is not a batch result ({err}); "
                    "refusing to append to a file this runner did not write"
                ) from err
            self.done.add(key)
            self.records += 1

    def append(self, record: dict[str, Any]) -> None:
        """One result, whole, on disk before this returns."""
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)
            if self.sync:
                os.fsync(self._fd)
            self.done.add((record["custom_id"], record["id"]))
            self.records += 1

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> ResultsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def result_record(
    line_key: tuple[str | None, str], status: int, body: Any, request_id: str
) -> dict[str, Any]:
    """A response line as the Batch API writes it; a non-2xx one also names its error."""
    custom_id, rid = line_key
    error = None
    if status >= 300:
        detail = body.get("error") if isinstance(body, dict) else None
        detail = detail if isinstance(detail, dict) else {}
        error = {
            "code": str(detail.get("code") or detail.get("type") or status),
            "message": str(detail.get("message") or body),
        }
    response = {"status_code": status, "request_id": request_id, "body": body}
    return {"id": rid, "custom_id": custom_id, "response": response, "error": error}


def error_record(line_key: tuple[str | None, str], code: str, message: str) -> dict[str, Any]:
    """A line that never ran (unreadable, or refused before it reached a route)."""
    custom_id, rid = line_key
    return {
        "id": rid,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
