"""Background responses through the official SDK: created `queued`, run by the proxy, polled to their end and
recorded like any response; streamed ones read as they come and again from a sequence number; cancelled while
queued or running; what cannot run refused at once or failing visibly; and one whose proxy was killed run again
or ended by its record."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import update

from proxy.app_keys import STATE
from proxy.state.tables import JOBS
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

FAST_JOBS = {"poll_interval_s": 0.05}


def client(harness: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key="unused-on-loopback", max_retries=0)


async def ended(sdk: openai.AsyncOpenAI, response_id: str, timeout_s: float = 20.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            response = await sdk.responses.retrieve(response_id)
            if response.status not in ("queued", "in_progress"):
                return response
            await asyncio.sleep(0.05)


async def test_a_background_response_is_queued_then_polled_to_its_answer_and_recorded(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.answer_delay_s = 0.3
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk = client(harness)
        raw = await sdk.responses.with_raw_response.create(
            model="fake-model", input="Of the sea.", max_output_tokens=4, temperature=0, background=True
        )
        queued = raw.parse()
        assert queued.status == "queued" and queued.background and queued.output == []
        assert raw.headers["Stackpin-Record"] == "rec_" + queued.id.removeprefix("resp_")
        assert (await sdk.responses.retrieve(queued.id)).status in ("queued", "in_progress")
        done = await ended(sdk, queued.id)
        assert (
            done.status == "incomplete" and done.background
        )  # max_output_tokens reached, as in the foreground
        assert done.output_text == replica.completion(replica.requests[-1])[2]
        record = await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local")
        assert record is not None and record.entries[0].content["belongs_to"] == {"background": True}
        assert "background" not in replica.requests[-1], (
            "the replica is asked for the answer, not a background run"
        )
        with pytest.raises(openai.BadRequestError, match="not streamed"):
            await sdk.responses.retrieve(queued.id, stream=True)
        items = await sdk.responses.input_items.list(queued.id)
        assert [i.content[0].text for i in items.data] == ["Of the sea."]  # type: ignore[union-attr]


async def test_a_streamed_background_response_is_read_as_it_comes_and_again_from_a_sequence_number(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.chunk_delay_s = 0.02
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk = client(harness)
        stream = await sdk.responses.create(
            model="fake-model",
            input="Sing.",
            max_output_tokens=6,
            temperature=0,
            background=True,
            stream=True,
        )
        sent = [event async for event in stream]
        assert sent[0].type == "response.created" and sent[-1].type == "response.incomplete", sent[-1]
        assert [e.sequence_number for e in sent] == list(range(len(sent)))
        final = sent[-1].response  # type: ignore[union-attr]
        again = [e async for e in await sdk.responses.retrieve(final.id, stream=True, starting_after=4)]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in sent[5:]], "the same events, kept"
        assert (await sdk.responses.retrieve(final.id)).output_text == final.output_text
        record = await harness.proxy.store.get_record("rec_" + final.id.removeprefix("resp_"), "local")
        assert record is not None and [e.part for e in record.entries] == ["opened", "closed"]


async def test_a_queued_or_running_background_response_is_cancelled(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.answer_delay_s = 2.0
    replica.chunk_delay_s = 0.2
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk = client(harness)
        running = await sdk.responses.create(model="fake-model", input="Long.", background=True)
        while (await sdk.responses.retrieve(running.id)).status != "in_progress":
            await asyncio.sleep(0.05)
        cancelled = await sdk.responses.cancel(running.id)
        assert cancelled.status == "cancelled"
        assert (await sdk.responses.retrieve(running.id)).status == "cancelled"
        assert (
            await harness.proxy.store.get_record("rec_" + running.id.removeprefix("resp_"), "local") is None
        ), "a cancelled answer was never given, so it has no record"

        stream = await sdk.responses.create(
            model="fake-model", input="Sing.", max_output_tokens=50, background=True, stream=True
        )
        seen = []
        async for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) == 5:
                await sdk.responses.cancel(seen[0].response.id)  # type: ignore[union-attr]
        assert seen[-1].type == "error" and "cancelled" in seen[-1].message  # type: ignore[union-attr]
        response_id = seen[0].response.id  # type: ignore[union-attr]
        assert (await sdk.responses.retrieve(response_id)).status == "cancelled"
        record = await harness.proxy.store.get_record("rec_" + response_id.removeprefix("resp_"), "local")
        assert record is not None and record.status == "interrupted", "what it sent is recorded"


async def test_what_cannot_run_in_the_background_is_refused_or_fails_visibly(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk = client(harness)
        with pytest.raises(openai.BadRequestError, match="store"):
            await sdk.responses.create(model="fake-model", input="x", background=True, store=False)
        with pytest.raises(openai.BadRequestError, match="colour"):  # what reading the request finds, at once
            await sdk.responses.create(model="fake-model", input="x", background=True,
                                       extra_body={"stackpin": {"colour": "red"}})  # fmt: skip
        answered = await sdk.responses.create(model="fake-model", input="x", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="only a background response"):
            await sdk.responses.cancel(answered.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.cancel("resp_" + "0" * 32)
        failing = await sdk.responses.create(
            model="fake-model",
            input="x",
            background=True,
            tools=[{"type": "web_search"}],  # type: ignore[list-item]
        )
        failed = await ended(sdk, failing.id)
        assert failed.status == "failed" and failed.error is not None and "web_search" in failed.error.message
        unserved = await ended(
            sdk, (await sdk.responses.create(model="no-such-model", input="x", background=True)).id
        )
        assert unserved.status == "failed" and "no-such-model" in unserved.error.message  # type: ignore[union-attr]


async def test_a_background_response_whose_proxy_was_killed_is_run_again_or_ended_by_its_record(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk, state = client(harness), harness.app[STATE]
        answered = await ended(
            sdk, (await sdk.responses.create(model="fake-model", input="Once.", background=True)).id
        )
        calls, never = len(replica.requests), "resp_" + "a" * 32
        # Two jobs a killed proxy was running: one it answered (its record is complete), one it never answered.
        killed = {"state": "running", "outcome": None, "owner": "killed-proxy", "attempts": 1,
                  "lease_until": datetime.now(UTC) - timedelta(seconds=60)}  # fmt: skip
        body = {"model": "fake-model", "input": "Twice.", "max_output_tokens": 3}
        async with state.db.write() as connection:
            await connection.execute(
                JOBS.insert().values(id=never, kind="response", tenant="local", cancel_requested=False,
                                     request=json.dumps({"body": body, "pin_header": None}), detail=None,
                                     created_at=datetime.now(UTC), **killed)
            )  # fmt: skip
            await connection.execute(update(JOBS).where(JOBS.c.id == answered.id).values(**killed))
        rerun = await ended(sdk, never)
        assert rerun.status == "incomplete" and rerun.output_text, "never answered, so run again here"
        again = await ended(sdk, answered.id)
        assert again.status == answered.status and again.output_text == answered.output_text
        assert len(replica.requests) == calls + 1, "an answer already recorded is never asked for twice"
