"""HTTP handlers of stored responses: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

Each reads the response's record from the audit store, tenant-scoped (another tenant's response is a 404, as an
unknown one), and answers with the record's headers. What a record shows as a stored response is
proxy/state/stored_responses.py's decision; a background response's job (proxy/state/background.py) says what it is
until its record is complete. `POST /v1/responses/{id}/cancel` cancels a background response.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

from proxy.app_keys import JOBS, PROXY, SECRETS, STATE, STORE
from proxy.audit import AuditRecord
from proxy.errors import BadRequest
from proxy.serving.auth import authenticate
from proxy.serving.responses_api import record_of
from proxy.serving.serve import RECORD_HEADER, STACK_HEADER
from proxy.state import queries
from proxy.state.background import follow, job_view
from proxy.state.jobs import Job
from proxy.state.stored_responses import (
    deleted_body,
    deletion_entry,
    input_page,
    readable,
    record_id_of,
    stored_body,
    stored_events,
)


async def _record(request: web.Request) -> tuple[str, str, AuditRecord | None]:
    """The tenant, the response id, and its record (None when there is none of this tenant's)."""
    tenant = authenticate(request.headers, request.app[SECRETS])
    response_id = request.match_info["response_id"]
    record = await request.app[STORE].get_record(record_id_of(response_id), tenant)
    return tenant, response_id, record


CANCEL_WAIT_S = 5.0


def _headers(record: AuditRecord) -> dict[str, str]:
    headers = {RECORD_HEADER: record.id}
    if record.fingerprint is not None:
        headers[STACK_HEADER] = record.fingerprint
    return headers


def json_response(body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def retrieve(request: web.Request) -> web.StreamResponse:
    """The stored response (a background one as its job stands until its record is complete); with
    `?stream=true`, its events again, after `starting_after` if given: a background one's as they come."""
    tenant = authenticate(request.headers, request.app[SECRETS])
    response_id = request.match_info["response_id"]
    # The job before the record: a background job finishes only once its record is written, so a finished job's
    # record is there to read. Read the other way round, a job that finished in between showed as finished with no
    # record, and its job's view said "completed" for an answer its record calls incomplete.
    job = await request.app[STATE].jobs.get(response_id, tenant, kind="response")
    record = await request.app[STORE].get_record(record_id_of(response_id), tenant)
    if queries.flag(request.query, "stream"):
        after = queries.whole(request.query, "starting_after", least=-1)
        if job is not None and not job.request["body"].get("stream"):
            raise BadRequest(f"response {response_id!r} was not streamed; leave 'stream' out", param="stream")
        if job is not None:
            return await follow(
                request, request.app[STATE], job, -1 if after is None else after, _job_headers(job)
            )
        events = stored_events(record, response_id, after)
        assert record is not None
        return await send_events(request, events, _headers(record))
    return _shown(job, record, response_id)


def _shown(job: Job | None, record: AuditRecord | None, response_id: str) -> web.Response:
    if job is not None and (job.state != "finished" or record is None):
        return json_response(job_view(job), _job_headers(job))
    body = stored_body(record, response_id)
    assert record is not None
    if job is not None:
        body["background"] = True
        if job.outcome == "cancelled":
            body["status"] = "cancelled"
    return json_response(body, _headers(record))


def _job_headers(job: Job) -> dict[str, str]:
    return {RECORD_HEADER: record_of(job.id)}


async def cancel(request: web.Request) -> web.Response:
    """Cancels a background response: at once while queued; a running one is stopped, and this waits a moment for
    that, then shows the response as it stands."""
    tenant, response_id, record = await _record(request)
    state, clock = request.app[STATE], request.app[PROXY].clock
    job = await state.jobs.request_cancel(response_id, tenant, clock())
    if job is None:
        stored_body(record, response_id)  # a 404 for what is no response of this tenant's
        raise BadRequest(
            "only a background response can be cancelled; this one was answered", param="response_id"
        )
    request.app[JOBS].cancel(job.id)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CANCEL_WAIT_S):
            while job is not None and job.state != "finished":
                await asyncio.sleep(0.05)
                job = await state.jobs.get(response_id, tenant)
    record = await request.app[STORE].get_record(record_id_of(response_id), tenant)
    return _shown(job, record, response_id)


async def send_events(request: web.Request, events: list[str], headers: dict[str, str]) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await response.prepare(request)
    for text in events:
        await response.write(text.encode())
    await response.write_eof()
    return response


async def delete(request: web.Request) -> web.Response:
    """Appends the flag that deletes it; the record stays in the log, provable."""
    _, response_id, found = await _record(request)
    record = readable(found, response_id)
    await request.app[STORE].append(deletion_entry(record, response_id, request.app[PROXY].clock()))
    return json_response(deleted_body(response_id), _headers(record))


async def list_input_items(request: web.Request) -> web.Response:
    _, response_id, record = await _record(request)
    after, limit, order = queries.page_options(request.query)
    return json_response(input_page(record, response_id, after=after, limit=limit, order=order))


def routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/responses/{response_id}", retrieve),
        web.delete("/v1/responses/{response_id}", delete),
        web.get("/v1/responses/{response_id}/input_items", list_input_items),
        web.post("/v1/responses/{response_id}/cancel", cancel),
    ]
