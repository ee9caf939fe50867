"""Where the Batch API's files and batches live: one directory (`--batch-dir`, made 0700), so a
restarted server finds every upload, every batch and the results its lines already have.

    <dir>/files/<file id>           the file's bytes (an upload, or a batch's output / errors)
    <dir>/files/<file id>.json      {"file": the File object, "tenant": its owner}
    <dir>/batches/<batch id>.json   {"batch": the Batch object, "tenant", "result_file_ids"}
    <dir>/batches/<batch id>.output.jsonl, .errors.jsonl
                                    the running batch's ResultsFiles (results_file.py), moved
                                    under files/ as its output and error files when it ends

Every JSON is written whole (a temporary file, fsynced, renamed over): a crash leaves the old
record or the new one, never half of either. Objects belong to a tenant; another tenant's is
"not found" (404), never "forbidden", so that ids say nothing about who else uses the server.
Ids are checked against their shape before they name a path."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError, UnknownRequestError

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
RESULT_KINDS = ("output", "error")  # a batch's two results files
log = logging.getLogger("flowlang.batch")


@dataclass
class BatchRecord:
    """A batch as stored: the public Batch object, its owner, and the ids its results files
    take when published (chosen at creation, so a finalize redone after a crash reuses them)."""

    batch: dict[str, Any]
    tenant: str
    result_file_ids: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.batch["id"]

    @property
    def status(self) -> str:
        return self.batch["status"]

    def set_status(self, status: str, at_field: str | None = None) -> None:
        """Move to `status`, stamping `at_field` (e.g. "completed_at") with the time now."""
        self.batch["status"] = status
        if at_field is not None:
            self.batch[at_field] = int(time.time())


class BatchStore:
    """Files and batch records under `root`, by tenant."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).expanduser()
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"

    def ensure(self) -> None:
        """Make the directories (0700: uploads are the tenants' data) if they are missing."""
        for folder in (self.root, self.files_dir, self.batches_dir):
            if not folder.is_dir():
                folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    # ------------------------------------------------------------------ files
    def add_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, Any]:
        """Store `data` as a new file of `tenant`; its File object."""
        self.ensure()
        file_id = "file-" + secrets.token_hex(12)
        _write_atomic(self.files_dir / file_id, data)
        return self._describe_file(tenant, file_id, filename, purpose)

    def publish(self, tenant: str, file_id: str, path: Path, filename: str) -> str | None:
        """Move a batch's results file at `path` in as file `file_id` (purpose batch_output);
        None, and the file removed, if it holds nothing. Redone after a crash, it finds the
        move made and writes the record again."""
        target = self.files_dir / file_id
        if path.exists():
            if path.stat().st_size == 0:
                path.unlink()
                return None
            os.replace(path, target)
        if not target.exists():
            return None
        self._describe_file(tenant, file_id, filename, "batch_output")
        return file_id

    def _describe_file(self, tenant: str, file_id: str, filename: str, purpose: str) -> dict:
        size = (self.files_dir / file_id).stat().st_size
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        _write_json(self.files_dir / f"{file_id}.json", {"file": obj, "tenant": tenant})
        return obj

    def file(self, tenant: str, file_id: str) -> dict[str, Any]:
        """`tenant`'s File object `file_id`; UnknownRequestError (404) for any other."""
        known = FILE_ID.fullmatch(file_id)
        record = _read_json(self.files_dir / f"{file_id}.json") if known else None
        if record is None or record.get("tenant") != tenant:
            raise UnknownRequestError(f"no file {file_id!r}")
        return record["file"]

    def file_path(self, tenant: str, file_id: str) -> Path:
        """Where `tenant`'s file `file_id` keeps its bytes (404 as file() does)."""
        self.file(tenant, file_id)
        return self.files_dir / file_id

    def files(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """`tenant`'s File objects (of `purpose`, if given), newest first."""
        found = []
        for path in self.files_dir.glob("file-*.json"):
            record = _read_json(path)
            if record is not None and record.get("tenant") == tenant:
                if purpose is None or record["file"]["purpose"] == purpose:
                    found.append(record["file"])
        return sorted(found, key=lambda f: (f["created_at"], f["id"]), reverse=True)

    def delete_file(self, tenant: str, file_id: str) -> None:
        """Remove `tenant`'s file `file_id` (its record first: a half-deleted file is gone)."""
        self.file(tenant, file_id)
        (self.files_dir / f"{file_id}.json").unlink()
        (self.files_dir / file_id).unlink(missing_ok=True)

    # ------------------------------------------------------------------ batches
    def new_batch(self, tenant: str, batch: dict[str, Any]) -> BatchRecord:
        """A new record for `batch` (its id is set here), stored."""
        self.ensure()
        batch["id"] = "batch_" + secrets.token_hex(12)
        ids = {kind: "file-" + secrets.token_hex(12) for kind in RESULT_KINDS}
        record = BatchRecord(batch, tenant, ids)
        self.save(record)
        return record

    def save(self, record: BatchRecord) -> None:
        """Store the record as it is now."""
        data = {"batch": record.batch, "tenant": record.tenant}
        data["result_file_ids"] = record.result_file_ids
        _write_json(self.batches_dir / f"{record.id}.json", data)

    def batch(self, tenant: str, batch_id: str) -> BatchRecord:
        """`tenant`'s batch `batch_id`; UnknownRequestError (404) for any other."""
        record = self._load(batch_id) if BATCH_ID.fullmatch(batch_id) else None
        if record is None or record.tenant != tenant:
            raise UnknownRequestError(f"no batch {batch_id!r}")
        return record

    def batches(self, tenant: str | None = None) -> list[BatchRecord]:
        """Every stored batch (of `tenant`, if given), newest first."""
        found = []
        for path in self.batches_dir.glob("batch_*.json"):
            record = self._load(path.stem)
            if record is not None and tenant in (None, record.tenant):
                found.append(record)
        return sorted(found, key=lambda r: (r.batch["created_at"], r.id), reverse=True)

    def results_path(self, batch_id: str, kind: str) -> Path:
        """Where a running batch appends its `kind` ("output" or "error") results."""
        return self.batches_dir / f"{batch_id}.{'output' if kind == 'output' else 'errors'}.jsonl"

    def lock_path(self, batch_id: str) -> Path:
        """The file a server holds locked while it runs the batch (so two never both do)."""
        return self.batches_dir / f"{batch_id}.lock"

    def _load(self, batch_id: str) -> BatchRecord | None:
        data = _read_json(self.batches_dir / f"{batch_id}.json")
        if data is None:
            return None
        return BatchRecord(data["batch"], data["tenant"], data.get("result_file_ids", {}))


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: up to `limit` items after the one with id `after`."""
    if not 1 <= limit <= 10_000:
        raise InvalidRequestError(f"limit must be 1 to 10000, not {limit}")
    ids = [item["id"] for item in items]
    start = ids.index(after) + 1 if after in ids else 0
    data = items[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(items),
    }


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _write_json(path: Path, value: Any) -> None:
    _write_atomic(path, json.dumps(value, ensure_ascii=False, indent=1).encode())


def _read_json(path: Path) -> Any:
    """The JSON at `path`, or None if there is none (a record removed meanwhile)."""
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # written whole: edited by hand
        log.warning("batch store: %s is not a record this server wrote (%s); skipped", path, err)
        return None
