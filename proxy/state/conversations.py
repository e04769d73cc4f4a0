"""Conversations: a tenant's list of items (messages, function calls and their outputs) that responses continue.

A response created with `conversation` is served on the conversation's items followed by its own input, and its
record holds that whole input, as for `previous_response_id`, with `belongs_to: {"conversation": id, "items": k}`
(its first k input items came from the conversation). Once it is answered its own input and its output are added to
the conversation, naming its record. Items and conversations are deleted by marking them; what a response was
given stays in its record. This module keeps the rows and makes the items; the routes are conversation_routes.py.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update

from proxy.endpoints import RESPONSES
from proxy.errors import BadRequest, NotFound
from proxy.serving.request import ClientRequest
from proxy.serving.responses_api import input_items
from proxy.state.database import StateDatabase
from proxy.state.tables import CONVERSATION_ITEMS, CONVERSATIONS

ITEMS = CONVERSATION_ITEMS
MAX_ITEMS_PER_CALL = 20  # as OpenAI's: items added at once
PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


@dataclass(frozen=True)
class Conversation:
    id: str
    tenant: str
    created_at: datetime
    metadata: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": int(self.created_at.timestamp()),
                "metadata": self.metadata}  # fmt: skip


def new_item(item: Any, where: str, taken: set[str]) -> dict[str, Any]:
    """An item as a conversation keeps and shows it: typed, with an id of its own (its given one unless the
    conversation holds that one already), a message's text as content parts."""
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an item object", param=where)
    kind = item.get("type", "message")
    if kind not in PREFIXES:
        raise BadRequest(f"{where}: items of type {kind!r} are not kept here", param=where)
    shown = {"type": kind, **item}
    if kind == "message":
        if not isinstance(item.get("role"), str):
            raise BadRequest(f"{where}: a message needs a role", param=where)
        if isinstance(item.get("content"), str):
            part = "output_text" if item["role"] == "assistant" else "input_text"
            shown["content"] = [{"type": part, "text": item["content"]}]
        shown.setdefault("status", "completed")
    if not isinstance(shown.get("id"), str) or shown["id"] in taken:
        shown["id"] = f"{PREFIXES[kind]}_{secrets.token_hex(16)}"
    taken.add(shown["id"])
    return shown


def check_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if (
        not isinstance(metadata, dict)
        or not all(isinstance(v, str) for v in metadata.values())
        or len(metadata) > 16
    ):
        raise BadRequest("metadata must be an object of at most 16 string values", param="metadata")
    return metadata


def conversation_id_of(value: Any) -> str:
    """The id a response's `conversation` names (a string, or an object with `id`)."""
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value.startswith("conv_"):
        raise BadRequest(
            'conversation must be a conversation\'s id (conv_...) or {"id": ...}', param="conversation"
        )
    return value


class Conversations:
    def __init__(self, db: StateDatabase) -> None:
        self._db = db

    async def create(
        self, tenant: str, metadata: dict[str, str], items: list[Any], now: datetime
    ) -> tuple[Conversation, list[dict[str, Any]]]:
        conversation = Conversation("conv_" + secrets.token_hex(24), tenant, now, metadata)
        async with self._db.write() as connection:
            await connection.execute(
                CONVERSATIONS.insert().values(id=conversation.id, tenant=tenant, created_at=now,
                                              metadata=json.dumps(metadata), deleted_at=None)
            )  # fmt: skip
        added = await self.add(conversation.id, tenant, items, None, now)
        return conversation, added or []

    async def get(self, conversation_id: str, tenant: str) -> Conversation | None:
        query = select(CONVERSATIONS).where(
            CONVERSATIONS.c.id == conversation_id,
            CONVERSATIONS.c.tenant == tenant,
            CONVERSATIONS.c.deleted_at.is_(None),
        )
        async with self._db.read() as connection:
            row = (await connection.execute(query)).mappings().one_or_none()
        if row is None:
            return None
        return Conversation(row["id"], row["tenant"], row["created_at"], json.loads(row["metadata"]))

    async def set_metadata(
        self, conversation_id: str, tenant: str, metadata: dict[str, str]
    ) -> Conversation | None:
        async with self._db.write() as connection:
            await connection.execute(
                update(CONVERSATIONS)
                .where(CONVERSATIONS.c.id == conversation_id, CONVERSATIONS.c.tenant == tenant,
                       CONVERSATIONS.c.deleted_at.is_(None))
                .values(metadata=json.dumps(metadata))
            )  # fmt: skip
        return await self.get(conversation_id, tenant)

    async def delete(self, conversation_id: str, tenant: str, now: datetime) -> bool:
        async with self._db.write() as connection:
            result = await connection.execute(
                update(CONVERSATIONS)
                .where(CONVERSATIONS.c.id == conversation_id, CONVERSATIONS.c.tenant == tenant,
                       CONVERSATIONS.c.deleted_at.is_(None))
                .values(deleted_at=now)
            )  # fmt: skip
            return bool(result.rowcount)

    async def add(
        self, conversation_id: str, tenant: str, items: list[Any], record_id: str | None, now: datetime
    ) -> list[dict[str, Any]] | None:
        """Appends items, in order; None when there is no such conversation of the tenant's. The conversation's row
        is locked while its items are numbered, so that two responses ending at once both land, one after the other."""
        owned = (
            select(CONVERSATIONS.c.id)
            .where(CONVERSATIONS.c.id == conversation_id, CONVERSATIONS.c.tenant == tenant,
                   CONVERSATIONS.c.deleted_at.is_(None))
            .with_for_update()
        )  # fmt: skip
        async with self._db.write() as connection:
            if (await connection.execute(owned)).scalar_one_or_none() is None:
                return None
            last = (
                await connection.execute(
                    select(func.max(ITEMS.c.position)).where(ITEMS.c.conversation_id == conversation_id)
                )
            ).scalar_one()
            taken = set(
                (
                    await connection.execute(
                        select(ITEMS.c.item_id).where(ITEMS.c.conversation_id == conversation_id)
                    )
                )
                .scalars()
                .all()
            )
            shown = [new_item(item, f"items[{i}]", taken) for i, item in enumerate(items)]
            start = -1 if last is None else last
            rows = [{"conversation_id": conversation_id, "position": start + 1 + i, "item_id": item["id"],
                     "item": json.dumps(item, ensure_ascii=False), "record_id": record_id, "created_at": now,
                     "deleted_at": None} for i, item in enumerate(shown)]  # fmt: skip
            if rows:
                await connection.execute(ITEMS.insert(), rows)
        return shown

    async def items(self, conversation_id: str, tenant: str) -> list[dict[str, Any]] | None:
        """Every item kept (not deleted), oldest first; None when there is no such conversation of the tenant's."""
        if await self.get(conversation_id, tenant) is None:
            return None
        query = (
            select(ITEMS.c.item)
            .where(ITEMS.c.conversation_id == conversation_id, ITEMS.c.deleted_at.is_(None))
            .order_by(ITEMS.c.position)
        )
        async with self._db.read() as connection:
            return [json.loads(text) for text in (await connection.execute(query)).scalars()]

    async def delete_item(self, conversation_id: str, tenant: str, item_id: str, now: datetime) -> bool:
        if await self.get(conversation_id, tenant) is None:
            return False
        async with self._db.write() as connection:
            result = await connection.execute(
                update(ITEMS)
                .where(ITEMS.c.conversation_id == conversation_id, ITEMS.c.item_id == item_id,
                       ITEMS.c.deleted_at.is_(None))
                .values(deleted_at=now)
            )  # fmt: skip
            return bool(result.rowcount)


async def in_conversation(conversations: Conversations, request: ClientRequest, tenant: str) -> ClientRequest:
    """A Responses request with `conversation` served on the conversation's items, then its own input."""
    if request.endpoint != RESPONSES or request.body.get("conversation") is None:
        return request
    if request.previous_response_id is not None:
        raise BadRequest("send conversation or previous_response_id, not both", param="conversation")
    conversation_id = conversation_id_of(request.body["conversation"])
    items = await conversations.items(conversation_id, tenant)
    if items is None:
        raise NotFound(f"no conversation {conversation_id!r} of yours", param="conversation")
    body = {k: v for k, v in request.body.items() if k != "conversation"}
    body["input"] = [*items, *input_items(request.body.get("input"))]
    belongs_to = {**(request.belongs_to or {}), "conversation": conversation_id, "items": len(items)}
    return replace(request, body=body, belongs_to=belongs_to)


async def keep_turn(
    conversations: Conversations,
    request: ClientRequest,
    record_id: str,
    tenant: str,
    output: list[Any],
    now: datetime,
) -> None:
    """After a response in a conversation is answered: its own input and its output join the conversation."""
    belongs = request.belongs_to or {}
    if belongs.get("conversation") is None:
        return
    own = input_items(request.body.get("input"))[belongs["items"] :]
    await conversations.add(belongs["conversation"], tenant, [*own, *output], record_id, now)
