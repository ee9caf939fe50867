"""`run_batch(..., results=path)`: each finished instance appended to a results file as it
ends (the batch file format: runtime/batches/results_file.py), and a rerun over the same file
skips the instances already there, giving back their recorded variables instead.

An instance is recognised by its index and a digest of the program's name and its arguments
(as JSON: dataclasses and pydantic models included), so changed arguments run again. Failed
instances are not recorded: a rerun tries them again."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from flowlang.errors import ProgramError, UnknownVariableError
from runtime.batches.lines import canonical, line_id
from runtime.batches.results_file import ResultsFile, result_record


def jsonable(value: Any, what: str) -> Any:
    """`value` as JSON data; a value with no JSON form is a TypeError naming `what`."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [jsonable(v, what) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: jsonable(v, what) for k, v in value.items()}
    try:
        return TypeAdapter(type(value)).dump_python(value, mode="json")
    except Exception as err:  # noqa: BLE001 - pydantic raises several kinds for a foreign type
        raise TypeError(f"{what}: a {type(value).__name__} has no JSON form") from err


class RecordedRun:
    """A finished instance read back from the results file: its variables and return value
    (as JSON data), read like a state (`run["reply"]`, `run.variables()`)."""

    def __init__(self, body: Mapping[str, Any]) -> None:
        self._variables = dict(body.get("variables", {}))
        self.return_value = body.get("return_value")

    def __getitem__(self, name: str) -> Any:
        if name not in self._variables:
            raise UnknownVariableError(f"the recorded run defines no variable {name!r}")
        return self._variables[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self._variables.get(name, default)

    def variables(self) -> dict[str, Any]:
        return dict(self._variables)


class NoResults:
    """run_batch without `results`: nothing recorded, nothing skipped."""

    def recorded(self, index: int) -> RecordedRun | None:
        return None

    def record(self, index: int, state: Any) -> None:
        pass

    def close(self) -> None:
        pass


class BatchResults:
    """The results file of one run_batch: what it holds, and each new instance appended."""

    def __init__(self, path: str | Path, name: str, batch: Sequence[Mapping[str, Any]]) -> None:
        try:
            arguments = [jsonable(dict(args), "an argument") for args in batch]
        except TypeError as err:
            raise ProgramError(f"run_batch(results=...): {err}") from err
        self.keys = [(str(i), line_id(canonical([name, args]))) for i, args in enumerate(arguments)]
        self.file = ResultsFile(path)
        wanted = set(self.keys)
        self.bodies = {key: body for key, body in _bodies(Path(path)) if key in wanted}

    def recorded(self, index: int) -> RecordedRun | None:
        body = self.bodies.get(self.keys[index])
        return RecordedRun(body) if body is not None else None

    def record(self, index: int, state: Any) -> None:
        body = {
            "variables": {k: jsonable(v, k) for k, v in state.variables().items()},
            "return_value": jsonable(state.return_value, "the return value"),
        }
        self.file.append(result_record(self.keys[index], 200, body, self.keys[index][1]))

    def close(self) -> None:
        self.file.close()


def _bodies(path: Path):
    """(key, response body) of every whole line (the ResultsFile opened first cut a torn one)."""
    for line in path.read_bytes().splitlines():
        if line.strip():
            record = json.loads(line)
            yield (record["custom_id"], record["id"]), (record.get("response") or {}).get("body")
