"""OpenAI's Files API, for batches: `/v1/files` (upload, list, retrieve, delete, content).

An upload is a multipart form (`file`, `purpose`), read whole within the server's body limit
(`--max-body-bytes`, 8 MiB by default: raise it for bigger batch files) and parsed here (the
form is simple; python-multipart would be a dependency for two fields). Only purpose "batch"
is accepted; a batch's output and error files are "batch_output", written by the server.
Files belong to the tenant that uploaded them (runtime/batches/store.py)."""

from __future__ import annotations

import asyncio
from email.parser import HeaderParser
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from runtime.batches.store import page
from runtime.errors import InvalidRequestError
from runtime.server.batches_api import batch_jobs
from runtime.server.state import ServerDep

router = APIRouter(prefix="/v1")

UPLOAD_PURPOSES = ("batch",)


@router.post("/files")
async def upload_file(request: Request, server: ServerDep) -> dict:
    """Store an uploaded file of the caller's; its File object."""
    content_type = request.headers.get("content-type", "")
    body = await request.body()  # bounded by the BodyLimit middleware (413 past the limit)
    form = await asyncio.to_thread(parse_form, content_type, body)
    purpose = form.get("purpose", (None, b""))[1].decode("utf-8", "replace")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequestError(
            f"purpose must be 'batch' (the only purpose this server stores), not {purpose!r}"
        )
    if "file" not in form:
        raise InvalidRequestError("file: the form has no file part")
    filename, data = form["file"]
    store = batch_jobs(request.app).store
    tenant = server.tenant(request)
    return await asyncio.to_thread(
        store.add_file, tenant, filename or "upload.jsonl", purpose, data
    )


@router.get("/files")
async def list_files(
    request: Request,
    server: ServerDep,
    purpose: str | None = None,
    after: str | None = None,
    limit: int = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict:
    """The caller's files (of `purpose`, if given), newest first unless `order` is asc."""
    store = batch_jobs(request.app).store
    files = await asyncio.to_thread(store.files, server.tenant(request), purpose)
    return page(files if order == "desc" else files[::-1], after, limit)


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, server: ServerDep) -> dict:
    """The caller's File object `file_id` (404 for anyone else's)."""
    store = batch_jobs(request.app).store
    return await asyncio.to_thread(store.file, server.tenant(request), file_id)


@router.get("/files/{file_id}/content")
async def file_content(file_id: str, request: Request, server: ServerDep) -> FileResponse:
    """The bytes of the caller's file `file_id`."""
    store = batch_jobs(request.app).store
    path = await asyncio.to_thread(store.file_path, server.tenant(request), file_id)
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, request: Request, server: ServerDep) -> dict:
    """Delete the caller's file `file_id`; not the input of a batch still running."""
    jobs = batch_jobs(request.app)
    tenant = server.tenant(request)
    batch_id = jobs.running_inputs(tenant).get(file_id)
    if batch_id is not None:
        raise InvalidRequestError(
            f"file {file_id!r} is the input of batch {batch_id!r}, still running: cancel it "
            "first, or wait for it to end"
        )
    await asyncio.to_thread(jobs.store.delete_file, tenant, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's parts: name -> (filename or None, bytes)."""
    header = HeaderParser().parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str):
        raise InvalidRequestError(
            "an upload is a multipart/form-data body (fields file and purpose), "
            f"not {content_type or 'a body without Content-Type'!r}"
        )
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    chunks = (b"\r\n" + body).split(delimiter)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise InvalidRequestError("the multipart body is cut short (no closing boundary)")
    form: dict[str, tuple[str | None, bytes]] = {}
    for chunk in chunks[1:-1]:
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise InvalidRequestError("a multipart part has no blank line after its headers")
        headers = HeaderParser().parsestr(head.decode("utf-8", "replace").lstrip(" \t\r\n"))
        name = headers.get_param("name", header="content-disposition")
        if isinstance(name, str):
            form[name] = (headers.get_filename(), content)
    return form
