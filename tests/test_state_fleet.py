"""Stored state across a fleet of two proxies on one PostgreSQL and Redis, through the official SDK: what one proxy
stores, the other serves. A response answered by one is retrieved, continued and deleted through the other; a
background response queued on one is polled, resumed and cancelled on the other; a conversation grows through both;
a batch created on one is read to its end on the other."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.audit_databases import audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import running_fleet
from tests.support.proxy_harness import Harness

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def client(harness: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key="unused-on-loopback", max_retries=0)


async def settled(sdk: openai.AsyncOpenAI, response_id: str) -> Any:
    async with asyncio.timeout(20):
        while (response := await sdk.responses.retrieve(response_id)).status in ("queued", "in_progress"):
            await asyncio.sleep(0.05)
    return response


async def test_what_one_proxy_stores_the_other_serves(replica: FakeReplica, tmp_path: Path) -> None:
    replica.chunk_delay_s = 0.01
    async with audit_database("postgres", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}, jobs={"poll_interval_s": 0.05}) as fleet:
            await fleet.sync_all()
            one, two = (client(proxy) for proxy in fleet.proxies)

            answered = await one.responses.create(
                model="fake-model", input="Sea.", max_output_tokens=3, temperature=0
            )
            assert (await two.responses.retrieve(answered.id)).output_text == answered.output_text
            continued = await two.responses.create(model="fake-model", input="Sky.", previous_response_id=answered.id,
                                                   max_output_tokens=3, temperature=0)  # fmt: skip
            assert len((await one.responses.input_items.list(continued.id)).data) == 3
            await two.responses.delete(answered.id)
            with pytest.raises(openai.NotFoundError):
                await one.responses.retrieve(answered.id)

            stream = await one.responses.create(model="fake-model", input="Sing.", max_output_tokens=5,
                                                temperature=0, background=True, stream=True)  # fmt: skip
            sent = [event async for event in stream]
            final = sent[-1].response  # type: ignore[union-attr]
            again = [e async for e in await two.responses.retrieve(final.id, stream=True, starting_after=2)]
            assert [e.model_dump() for e in again] == [e.model_dump() for e in sent[3:]]
            replica.answer_delay_s = 2.0
            slow = await two.responses.create(model="fake-model", input="Slow.", background=True)
            while (await one.responses.retrieve(slow.id)).status != "in_progress":
                await asyncio.sleep(0.05)
            assert (await one.responses.cancel(slow.id)).status == "cancelled"
            assert (await settled(two, slow.id)).status == "cancelled"
            replica.answer_delay_s = 0.0

            conversation = await one.conversations.create()
            for sdk, text in ((one, "Hello."), (two, "Again.")):
                await sdk.responses.create(model="fake-model", input=text, conversation=conversation.id,
                                           max_output_tokens=2)  # fmt: skip
            assert len((await two.conversations.items.list(conversation.id)).data) == 4

            line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
                    "body": {"model": "fake-model", "input": "the sea"}}  # fmt: skip
            uploaded = await one.files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
            batch = await one.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
            )
            async with asyncio.timeout(20):
                while (batch := await two.batches.retrieve(batch.id)).status != "completed":
                    await asyncio.sleep(0.05)
            output = (await two.files.content(batch.output_file_id)).text  # type: ignore[arg-type]
            assert json.loads(output)["response"]["body"]["data"][0]["object"] == "embedding"
