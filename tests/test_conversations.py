"""Conversations through the official SDK: created, read, renamed and deleted, their items added, listed, read and
deleted; a response on a conversation is served on its items and then joins it, plain, streamed or in the
background, and its record holds the whole input; tenants see only their own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy


def client(harness: Harness, key: str = "unused-on-loopback") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key=key, max_retries=0)


def texts(items: list[object]) -> list[str]:
    return [item.content[0].text for item in items]  # type: ignore[attr-defined]


async def test_a_conversation_and_its_items_are_kept_as_openai_documents(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        conversation = await sdk.conversations.create(
            items=[{"type": "message", "role": "user", "content": "first"}], metadata={"topic": "sea"}
        )
        assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "sea"}
        assert (await sdk.conversations.retrieve(conversation.id)).id == conversation.id
        assert (await sdk.conversations.update(conversation.id, metadata={"topic": "sky"})).metadata == {
            "topic": "sky"
        }
        added = await sdk.conversations.items.create(
            conversation.id, items=[{"type": "message", "role": "user", "content": "second"},
                                    {"type": "message", "role": "assistant", "content": "third"}],
        )  # fmt: skip
        assert texts(added.data) == ["second", "third"]
        newest_first = [item async for item in sdk.conversations.items.list(conversation.id, limit=2)]
        assert texts(newest_first) == ["third", "second", "first"], "pages followed by the SDK, newest first"
        one = await sdk.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)
        assert texts([one]) == ["second"]
        await sdk.conversations.items.delete(added.data[0].id, conversation_id=conversation.id)
        assert texts((await sdk.conversations.items.list(conversation.id, order="asc")).data) == [
            "first",
            "third",
        ]
        deleted = await sdk.conversations.delete(conversation.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await sdk.conversations.retrieve(conversation.id)


async def test_a_response_on_a_conversation_is_served_on_its_items_and_joins_it(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, jobs={"poll_interval_s": 0.05}) as harness:
        sdk = client(harness)
        conversation = await sdk.conversations.create(
            items=[{"type": "message", "role": "user", "content": "Hi."}]
        )
        raw = await sdk.responses.with_raw_response.create(
            model="fake-model",
            input="Of the sea.",
            conversation=conversation.id,
            max_output_tokens=3,
            temperature=0,
        )
        first = raw.parse()
        assert [m["content"] for m in replica.requests[-1]["messages"]] == ["Hi.", "Of the sea."]
        record = await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local")
        assert record is not None
        opened = record.entries[0].content
        assert opened["belongs_to"] == {"conversation": conversation.id, "items": 1}
        assert (
            len(opened["translated_from"]["input"]) == 2 and "conversation" not in opened["translated_from"]
        )
        items = (await sdk.conversations.items.list(conversation.id, order="asc")).data
        assert texts(items) == ["Hi.", "Of the sea.", first.output_text]
        assert items[-1].id == first.output[0].id, "the output joins under its own id"

        stream = await sdk.responses.create(
            model="fake-model", input="And the sky?", conversation={"id": conversation.id}, max_output_tokens=2,
            temperature=0, stream=True,
        )  # fmt: skip
        final = [event async for event in stream][-1].response  # type: ignore[union-attr]
        assert [m["content"] for m in replica.requests[-1]["messages"]][:3] == [
            "Hi.",
            "Of the sea.",
            first.output_text,
        ]
        background = await sdk.responses.create(
            model="fake-model",
            input="Last.",
            conversation=conversation.id,
            max_output_tokens=2,
            background=True,
        )
        async with asyncio.timeout(20):
            while (await sdk.responses.retrieve(background.id)).status in ("queued", "in_progress"):
                await asyncio.sleep(0.05)
        done = await sdk.responses.retrieve(background.id)
        items = (await sdk.conversations.items.list(conversation.id, order="asc", limit=100)).data
        assert texts(items) == ["Hi.", "Of the sea.", first.output_text, "And the sky?", final.output_text, "Last.",
                                done.output_text]  # fmt: skip


async def test_what_a_conversation_cannot_be_is_refused(replica: FakeReplica, tmp_path: Path) -> None:
    tenants = [{"name": "a", "api_key_env": "A_KEY"}, {"name": "b", "api_key_env": "B_KEY"}]
    environ = {"A_KEY": "sk-a", "B_KEY": "sk-b"}
    async with running_proxy([replica], tmp_path, tenants=tenants, environ=environ) as harness:
        a, b = client(harness, "sk-a"), client(harness, "sk-b")
        conversation = await a.conversations.create()
        for call in (b.conversations.retrieve, b.conversations.delete, b.conversations.items.list):
            with pytest.raises(openai.NotFoundError):
                await call(conversation.id)  # type: ignore[operator]
        with pytest.raises(openai.NotFoundError, match="conversation"):
            await b.responses.create(model="fake-model", input="x", conversation=conversation.id)
        answered = await a.responses.create(model="fake-model", input="x", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="not both"):
            await a.responses.create(model="fake-model", input="y", conversation=conversation.id,
                                     previous_response_id=answered.id)  # fmt: skip
        with pytest.raises(openai.BadRequestError, match="items"):
            await a.conversations.items.create(conversation.id, items=[])
        with pytest.raises(openai.BadRequestError, match="not kept here"):
            await a.conversations.items.create(conversation.id, items=[{"type": "reasoning", "summary": []}])  # type: ignore[list-item]
        with pytest.raises(openai.BadRequestError, match="metadata"):
            await a.conversations.create(metadata={"n": 1})  # type: ignore[dict-item]
