"""HTTP handlers of the Files and Batch APIs: `POST /v1/files` (multipart, purpose `batch`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`.

Everything is tenant-scoped: another tenant's file or batch is a 404, as an unknown one. An upload is read in
pieces and refused with a 413 naming `[batches] max_file_bytes` once it passes it; a batch's input file is read and
checked when the batch is created (a 400 naming the first bad line), and the batch is queued as a job that any proxy
may run (proxy/state/batch_run.py).
"""

from __future__ import annotations

import asyncio
import secrets

from aiohttp import BodyPartReader, web

from proxy.app_keys import JOBS, PROXY, SECRETS, SETTINGS, STATE
from proxy.errors import BadRequest, NotFound, PayloadTooLarge, RequestTimeout
from proxy.serving.auth import authenticate
from proxy.serving.handlers import read_body
from proxy.serving.request import parse_body
from proxy.state import queries
from proxy.state.batches import batch_hex, batch_object, create_options, read_lines
from proxy.state.files import StoredFile
from proxy.state.jobs import Job
from proxy.state.response_routes import json_response

UPLOAD_PURPOSES = ("batch",)
CHUNK = 1 << 16


async def upload_file(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    settings = request.app[SETTINGS]
    if not request.content_type.startswith("multipart/"):
        raise BadRequest("send the file as multipart/form-data, with the fields 'file' and 'purpose'")
    try:
        async with asyncio.timeout(settings.server.body_timeout_s):
            purpose, filename, content = await _read_upload(request, settings.batches.max_file_bytes)
    except TimeoutError:
        raise RequestTimeout(
            f"the upload did not arrive within {settings.server.body_timeout_s:g} s (server.body_timeout_s)"
        ) from None
    if purpose not in UPLOAD_PURPOSES:
        raise BadRequest(
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}", param="purpose"
        )
    if content is None:
        raise BadRequest("the upload has no 'file' field", param="file")
    file_id = "file-" + secrets.token_hex(12)
    stored = await request.app[STATE].files.put(
        file_id, tenant, purpose, filename or "upload.jsonl", content, request.app[PROXY].clock()
    )
    return json_response(stored.as_json())


async def _read_upload(request: web.Request, limit: int) -> tuple[str | None, str | None, bytes | None]:
    purpose, filename, content = None, None, None
    async for part in await request.multipart():
        if not isinstance(part, BodyPartReader):
            raise BadRequest("nested multipart bodies are not read; send the fields 'file' and 'purpose'")
        if part.name == "purpose":
            purpose = (await _bounded(part, 1024)).decode("utf-8", "replace").strip()
        elif part.name == "file":
            filename = part.filename
            content = await _bounded(part, limit, what="the file")
    return purpose, filename, content


async def _bounded(part: BodyPartReader, limit: int, what: str | None = None) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK):
        data += chunk
        if len(data) > limit:
            if what is None:
                raise BadRequest(f"the field {part.name!r} is longer than {limit} bytes", param=part.name)
            raise PayloadTooLarge(
                f"{what} is larger than this proxy keeps: {limit} bytes ([batches] max_file_bytes)"
            )
    return bytes(data)


async def _file(request: web.Request) -> tuple[str, StoredFile]:
    tenant = authenticate(request.headers, request.app[SECRETS])
    file_id = request.match_info["file_id"]
    stored = await request.app[STATE].files.get(file_id, tenant)
    if stored is None:
        raise NotFound(f"no file {file_id!r} of yours", param="file_id")
    return tenant, stored


async def retrieve_file(request: web.Request) -> web.Response:
    _, stored = await _file(request)
    return json_response(stored.as_json())


async def file_content(request: web.Request) -> web.Response:
    tenant, stored = await _file(request)
    content = await request.app[STATE].files.content(stored.id, tenant)
    if content is None:
        raise NotFound(f"no file {stored.id!r} of yours", param="file_id")
    return web.Response(body=content, content_type="application/octet-stream")


async def list_files(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    limit = queries.whole(request.query, "limit", 100, least=1) or 100
    files = await request.app[STATE].files.listed(tenant, request.query.get("purpose"), min(limit, 10_000))
    return json_response({"object": "list", "data": [f.as_json() for f in files], "has_more": False})


async def create_batch(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    state, settings = request.app[STATE], request.app[SETTINGS]
    file_id, endpoint, metadata = create_options(parse_body(await read_body(request)))
    stored = await state.files.get(file_id, tenant)
    content = await state.files.content(file_id, tenant) if stored is not None else None
    if stored is None or content is None or stored.purpose != "batch":
        raise BadRequest(f"input_file_id {file_id!r} names no file of yours with purpose 'batch'",
                         param="input_file_id")  # fmt: skip
    lines = read_lines(content, endpoint, max_lines=settings.batches.max_lines)
    batch_id = "batch_" + secrets.token_hex(16)
    job_request = {"endpoint": endpoint, "input_file_id": file_id, "metadata": metadata, "lines": len(lines)}
    job = await state.jobs.create(batch_id, "batch", tenant, job_request, request.app[PROXY].clock())
    request.app[JOBS].wake()
    return json_response(batch_object(job, (0, 0)))


async def _batch(request: web.Request) -> Job:
    tenant = authenticate(request.headers, request.app[SECRETS])
    batch_id = request.match_info["batch_id"]
    batch_hex(batch_id)
    job = await request.app[STATE].jobs.get(batch_id, tenant, kind="batch")
    if job is None:
        raise NotFound(f"no batch {batch_id!r} of yours", param="batch_id")
    return job


async def _shown(request: web.Request, job: Job) -> web.Response:
    return json_response(batch_object(job, await request.app[STATE].lines.counts(job.id)))


async def retrieve_batch(request: web.Request) -> web.Response:
    return await _shown(request, await _batch(request))


async def cancel_batch(request: web.Request) -> web.Response:
    job = await _batch(request)
    cancelled = await request.app[STATE].jobs.request_cancel(job.id, job.tenant, request.app[PROXY].clock())
    assert cancelled is not None
    request.app[JOBS].cancel(job.id)
    return await _shown(request, cancelled)


async def list_batches(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    after, limit, _ = queries.page_options(request.query)
    state = request.app[STATE]
    jobs = await state.jobs.listed("batch", tenant, after=after, limit=limit + 1)
    data = [batch_object(job, await state.lines.counts(job.id)) for job in jobs[:limit]]
    return json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit})  # fmt: skip


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/files", upload_file),
        web.get("/v1/files", list_files),
        web.get("/v1/files/{file_id}", retrieve_file),
        web.get("/v1/files/{file_id}/content", file_content),
        web.post("/v1/batches", create_batch),
        web.get("/v1/batches", list_batches),
        web.get("/v1/batches/{batch_id}", retrieve_batch),
        web.post("/v1/batches/{batch_id}/cancel", cancel_batch),
    ]
