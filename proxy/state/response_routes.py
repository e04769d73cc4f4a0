"""HTTP handlers of stored responses: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

Each reads the response's record from the audit store, tenant-scoped (another tenant's response is a 404, as an
unknown one), and answers with the record's headers. What a record shows as a stored response is
proxy/state/stored_responses.py's decision; a background response still queued or running is the jobs' (later).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from proxy.app_keys import PROXY, SECRETS, STORE
from proxy.audit import AuditRecord
from proxy.serving.auth import authenticate
from proxy.serving.serve import RECORD_HEADER, STACK_HEADER
from proxy.state import queries
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


def _headers(record: AuditRecord) -> dict[str, str]:
    headers = {RECORD_HEADER: record.id}
    if record.fingerprint is not None:
        headers[STACK_HEADER] = record.fingerprint
    return headers


def json_response(body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def retrieve(request: web.Request) -> web.StreamResponse:
    """The stored response; with `?stream=true`, its events again, after `starting_after` if given."""
    _, response_id, record = await _record(request)
    if queries.flag(request.query, "stream"):
        after = queries.whole(request.query, "starting_after", least=-1)
        events = stored_events(record, response_id, after)
        assert record is not None
        return await send_events(request, events, _headers(record))
    body = stored_body(record, response_id)
    assert record is not None
    return json_response(body, _headers(record))


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
    ]
