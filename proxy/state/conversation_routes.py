"""HTTP handlers of the Conversations API, as OpenAI documents it: `POST /v1/conversations`, `GET`, `POST` (its
metadata) and `DELETE /v1/conversations/{id}`, `GET` and `POST /v1/conversations/{id}/items`, and `GET` and `DELETE
/v1/conversations/{id}/items/{item_id}`. Tenant-scoped: another tenant's conversation is a 404, as an unknown one.
How a response continues a conversation is proxy/state/conversations.py's."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from proxy.app_keys import PROXY, SECRETS, STATE
from proxy.errors import BadRequest, NotFound
from proxy.serving.auth import authenticate
from proxy.serving.handlers import read_body
from proxy.serving.request import parse_body
from proxy.state import queries
from proxy.state.conversations import MAX_ITEMS_PER_CALL, Conversation, check_metadata
from proxy.state.response_routes import json_response
from proxy.state.stored_responses import page


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await read_body(request)
    return parse_body(raw) if raw.strip() else {}


def _items_of(body: dict[str, Any], *, required: bool) -> list[Any]:
    items = body.get("items")
    if items is None and not required:
        return []
    if not isinstance(items, list) or (required and not items) or len(items) > MAX_ITEMS_PER_CALL:
        raise BadRequest(f"items must be a list of 1 to {MAX_ITEMS_PER_CALL} items", param="items")
    return items


async def _conversation(request: web.Request) -> tuple[str, Conversation]:
    tenant = authenticate(request.headers, request.app[SECRETS])
    conversation_id = request.match_info["conversation_id"]
    found = await request.app[STATE].conversations.get(conversation_id, tenant)
    if found is None:
        raise NotFound(f"no conversation {conversation_id!r} of yours", param="conversation_id")
    return tenant, found


async def create(request: web.Request) -> web.Response:
    tenant = authenticate(request.headers, request.app[SECRETS])
    body = await _body(request)
    items, metadata = _items_of(body, required=False), check_metadata(body.get("metadata"))
    conversation, _ = await request.app[STATE].conversations.create(
        tenant, metadata, items, request.app[PROXY].clock()
    )
    return json_response(conversation.as_json())


async def retrieve(request: web.Request) -> web.Response:
    _, conversation = await _conversation(request)
    return json_response(conversation.as_json())


async def update(request: web.Request) -> web.Response:
    tenant, conversation = await _conversation(request)
    metadata = check_metadata((await _body(request)).get("metadata"))
    updated = await request.app[STATE].conversations.set_metadata(conversation.id, tenant, metadata)
    if updated is None:
        raise NotFound(f"no conversation {conversation.id!r} of yours", param="conversation_id")
    return json_response(updated.as_json())


async def delete(request: web.Request) -> web.Response:
    tenant, conversation = await _conversation(request)
    await request.app[STATE].conversations.delete(conversation.id, tenant, request.app[PROXY].clock())
    return json_response({"id": conversation.id, "object": "conversation.deleted", "deleted": True})


async def add_items(request: web.Request) -> web.Response:
    tenant, conversation = await _conversation(request)
    items = _items_of(await _body(request), required=True)
    added = await request.app[STATE].conversations.add(
        conversation.id, tenant, items, None, request.app[PROXY].clock()
    )
    if added is None:
        raise NotFound(f"no conversation {conversation.id!r} of yours", param="conversation_id")
    return json_response(page(added, after=None, limit=len(added), order="asc"))


async def _all_items(request: web.Request) -> tuple[str, Conversation, list[dict[str, Any]]]:
    tenant, conversation = await _conversation(request)
    items = await request.app[STATE].conversations.items(conversation.id, tenant)
    return tenant, conversation, items or []


async def list_items(request: web.Request) -> web.Response:
    after, limit, order = queries.page_options(request.query)
    _, _, items = await _all_items(request)
    return json_response(page(items, after=after, limit=limit, order=order))


async def retrieve_item(request: web.Request) -> web.Response:
    _, conversation, items = await _all_items(request)
    item_id = request.match_info["item_id"]
    found = next((item for item in items if item.get("id") == item_id), None)
    if found is None:
        raise NotFound(f"no item {item_id!r} in conversation {conversation.id}", param="item_id")
    return json_response(found)


async def delete_item(request: web.Request) -> web.Response:
    tenant, conversation = await _conversation(request)
    item_id = request.match_info["item_id"]
    if not await request.app[STATE].conversations.delete_item(
        conversation.id, tenant, item_id, request.app[PROXY].clock()
    ):
        raise NotFound(f"no item {item_id!r} in conversation {conversation.id}", param="item_id")
    return json_response(conversation.as_json())


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/conversations", create),
        web.get("/v1/conversations/{conversation_id}", retrieve),
        web.post("/v1/conversations/{conversation_id}", update),
        web.delete("/v1/conversations/{conversation_id}", delete),
        web.get("/v1/conversations/{conversation_id}/items", list_items),
        web.post("/v1/conversations/{conversation_id}/items", add_items),
        web.get("/v1/conversations/{conversation_id}/items/{item_id}", retrieve_item),
        web.delete("/v1/conversations/{conversation_id}/items/{item_id}", delete_item),
    ]
