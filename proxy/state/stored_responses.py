"""Stored responses, read from the audit log: a response's record is its stored copy.

A response's id is its record's (`resp_<hex>` for `rec_<hex>`, proxy/serving/responses_api.py), so
`GET /v1/responses/{id}` reads the record: the response the client got (a stream's: what its events assembled
into), and its fully expanded input for `input_items`. A request with `store: false` is answered and recorded like
any other, and is never shown as a stored response. Deleting a response appends a `flag` entry of status `deleted`
to its record, which stays in the log, provable; from then on it is not shown, nor continued. Pure functions: the
handlers (proxy/state/response_routes.py) read the record and append the entry.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from proxy.audit import AuditRecord, EntryView, SealedEntry, seal
from proxy.endpoints import RESPONSES
from proxy.errors import BadRequest, NotFound
from proxy.serving.responses_api import input_items, record_of

DELETED = "deleted"
ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def record_id_of(response_id: str) -> str:
    """The record a response id names; a 404 for what is no response id of this proxy."""
    try:
        return record_of(response_id)
    except BadRequest:
        raise NotFound(
            f"no response {response_id!r} (response ids look like resp_<32 hex>)", param="response_id"
        ) from None


def _parts(record: AuditRecord) -> dict[str, EntryView]:
    return {entry.part: entry for entry in record.entries}


def request_of(record: AuditRecord) -> dict[str, Any]:
    """The client's request in its own terms: for a translated one the request before translation, with
    `previous_response_id` resolved into its whole input."""
    parts = _parts(record)
    first = parts.get("answer") or parts.get("opened")
    if first is None:
        return {}
    content = first.content
    request = content.get("translated_from") or content.get("request")
    return request if isinstance(request, dict) else {}


def unreadable(record: AuditRecord | None) -> str | None:
    """Why a record is not a stored response (None when it is one)."""
    if record is None:
        return "no response of yours has this id"
    first = _parts(record).get("answer") or _parts(record).get("opened")
    if first is None or first.content.get("endpoint") != RESPONSES:
        return "its record holds no response"
    if any(flag.status == DELETED for flag in record.flags):
        return "it was deleted"
    if request_of(record).get("store") is False:
        return "it was created with store: false: answered and recorded, not stored"
    return None


def readable(record: AuditRecord | None, response_id: str) -> AuditRecord:
    """The record of a stored response; a 404 saying why when it is none (see `unreadable`)."""
    problem = unreadable(record)
    if problem is not None or record is None:
        raise NotFound(f"no stored response {response_id!r}: {problem}", param="response_id")
    return record


def stored_body(found: AuditRecord | None, response_id: str) -> dict[str, Any]:
    """The response as stored, as the client got it but for the id, which is the response's own."""
    record = readable(found, response_id)
    parts = _parts(record)
    answer = parts.get("answer")
    body = dict(answer.content["response"]) if answer is not None else _streamed_body(record, parts)
    body["id"] = response_id
    body["system_fingerprint"] = record.fingerprint
    return body


def _streamed_body(record: AuditRecord, parts: dict[str, EntryView]) -> dict[str, Any]:
    closed = parts.get("closed")
    if closed is None:
        # Still streaming (or left open by a proxy that stopped, until the next start closes it).
        return {"object": "response", "status": "in_progress", "output": [], "created_at": _created(record)}
    answer = closed.content.get("answer")
    body = dict(answer) if isinstance(answer, dict) else {"object": "response", "output": []}
    if closed.status != "complete":
        body["status"] = "failed"
        body["error"] = {"code": "stream_interrupted", "message": str(closed.content.get("error"))}
    return body


def _created(record: AuditRecord) -> int:
    return int(record.created_at.timestamp())


def stored_events(found: AuditRecord | None, response_id: str, after: int | None) -> list[str]:
    """A streamed response's events as its client was sent them, the one after its record closed included, from
    the one after sequence number `after`; a 400 for a response that was not streamed or is still streaming."""
    record = readable(found, response_id)
    closed = _parts(record).get("closed")
    if "opened" not in _parts(record):
        raise BadRequest(f"response {response_id!r} was not streamed; leave 'stream' out", param="stream")
    if closed is None or not isinstance(closed.content.get("events"), list):
        raise BadRequest(f"response {response_id!r} has no recorded events to stream yet", param="stream")
    events = [
        *closed.content["events"],
        *([closed.content["terminal"]] if closed.content.get("terminal") else []),
    ]
    return [text for text in events if after is None or sequence_number(text) > after]


def sequence_number(event: str) -> int:
    """The `sequence_number` of one event as it was sent (`event: NAME\ndata: {...}\n\n`); -1 if it has none."""
    data = next((line[6:] for line in event.splitlines() if line.startswith("data: ")), "")
    try:
        value = json.loads(data).get("sequence_number")
    except (ValueError, AttributeError):
        return -1
    return value if isinstance(value, int) else -1


def input_page(
    found: AuditRecord | None, response_id: str, *, after: str | None, limit: int, order: str
) -> dict[str, Any]:
    """`GET /v1/responses/{id}/input_items`: the response's fully expanded input, as OpenAI pages it."""
    record = readable(found, response_id)
    hex_id = response_id.removeprefix("resp_")
    items = [with_id(item, hex_id, i) for i, item in enumerate(input_items(request_of(record).get("input")))]
    return page(items, after=after, limit=limit, order=order)


def page(items: list[dict[str, Any]], *, after: str | None, limit: int, order: str) -> dict[str, Any]:
    """A list page as OpenAI's list endpoints answer: items after the one named `after`, in `order`."""
    ordered = items if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise BadRequest(f"after: no item {after!r} in this list", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": len(ordered) > limit,
    }


def with_id(item: dict[str, Any], hex_id: str, i: int) -> dict[str, Any]:
    """An input item as the API lists it: typed, with an id (one of its own, or its place in the input), and a
    message's text as content parts."""
    kind = item.get("type", "message")
    shown = {"type": kind, **item}
    if "id" not in shown:
        shown["id"] = f"{ITEM_PREFIXES.get(kind, 'item')}_{hex_id}_{i}"
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        shown["content"] = [{"type": part, "text": item["content"]}]
    if kind == "message":
        shown.setdefault("status", "completed")
    return shown


def deletion_entry(record: AuditRecord, response_id: str, now: datetime) -> SealedEntry:
    """The flag that deletes a stored response: appended, never an edit; the record stays provable."""
    return seal(
        record_id=record.id,
        part="flag",
        tenant=record.tenant,
        created_at=now,
        status=DELETED,
        content={"reason": DELETED, "response_id": response_id, "deleted_at": now.isoformat()},
    )


def deleted_body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}
