"""Stored responses through the official SDK: `responses.retrieve` (whole, and streamed again from a sequence
number), `responses.input_items.list`, `responses.delete`, `store: false`, and tenants that see only their own."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy


def client(harness: Harness, key: str = "unused-on-loopback") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key=key, max_retries=0)


async def test_a_response_is_retrieved_as_it_was_given_and_its_expanded_input_is_listed(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        first = await sdk.responses.create(
            model="fake-model", input="Of the sea.", max_output_tokens=4, temperature=0
        )
        second = await sdk.responses.create(
            model="fake-model", input="And the sky?", previous_response_id=first.id, max_output_tokens=3,
            temperature=0,
        )  # fmt: skip
        raw = await sdk.responses.with_raw_response.retrieve(second.id)
        got = raw.parse()
        assert got.model_dump() == second.model_dump(), "the stored response is the one the client got"
        assert raw.headers["Stackpin-Record"] == "rec_" + second.id.removeprefix("resp_")
        assert raw.headers["Stackpin-Stack"] == replica.fingerprint == got.system_fingerprint  # type: ignore[attr-defined]

        items = [item async for item in sdk.responses.input_items.list(second.id, order="asc")]
        texts = [item.content[0].text for item in items]  # type: ignore[union-attr]
        assert texts == ["Of the sea.", first.output_text, "And the sky?"], (
            "the fully expanded input, in order"
        )
        assert items[1].id == first.output[0].id, "an output item keeps its id"
        assert len({item.id for item in items}) == 3
        newest = await sdk.responses.input_items.list(second.id, limit=1)
        assert [i.id for i in newest.data] == [items[-1].id] and newest.has_more, "newest first by default"


async def test_a_streamed_response_streams_again_from_after_a_sequence_number(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        stream = await sdk.responses.create(
            model="fake-model", input="Sing.", max_output_tokens=4, temperature=0, stream=True
        )
        sent = [event async for event in stream]
        final = sent[-1].response  # type: ignore[union-attr]
        again = [
            event async for event in await sdk.responses.retrieve(final.id, stream=True, starting_after=2)
        ]
        assert [e.sequence_number for e in again] == [e.sequence_number for e in sent[3:]]
        assert [e.model_dump() for e in again] == [e.model_dump() for e in sent[3:]]
        whole = await sdk.responses.retrieve(final.id)
        assert whole.output_text == final.output_text and whole.status == final.status


async def test_a_deleted_response_is_gone_for_the_client_and_stays_in_the_log(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        response = await sdk.responses.create(model="fake-model", input="Hello", max_output_tokens=2)
        await sdk.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError, match="deleted"):
            await sdk.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.input_items.list(response.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.delete(response.id)
        with pytest.raises(openai.BadRequestError, match="deleted"):
            await sdk.responses.create(model="fake-model", input="more", previous_response_id=response.id)
        record = await harness.proxy.store.get_record("rec_" + response.id.removeprefix("resp_"), "local")
        assert record is not None and [e.part for e in record.entries] == ["answer"], "the record stays whole"
        assert [(f.part, f.status) for f in record.flags] == [("flag", "deleted")]
        await harness.proxy.store.integrate()
        assert (await harness.proxy.store.verify()).ok, "a deletion is an entry of the log, not an edit"


async def test_store_false_is_answered_and_recorded_but_not_stored(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        raw = await sdk.responses.with_raw_response.create(
            model="fake-model", input="Hello", max_output_tokens=2, store=False
        )
        response = raw.parse()
        assert response.output_text
        assert await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local") is not None
        with pytest.raises(openai.NotFoundError, match="store: false"):
            await sdk.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError, match="store: false"):
            await sdk.responses.create(model="fake-model", input="more", previous_response_id=response.id)


async def test_a_tenant_sees_only_its_own_responses(replica: FakeReplica, tmp_path: Path) -> None:
    tenants = [{"name": "a", "api_key_env": "A_KEY"}, {"name": "b", "api_key_env": "B_KEY"}]
    environ = {"A_KEY": "sk-a", "B_KEY": "sk-b"}
    async with running_proxy([replica], tmp_path, tenants=tenants, environ=environ) as harness:
        response = await client(harness, "sk-a").responses.create(
            model="fake-model", input="Hi", max_output_tokens=2
        )
        assert (await client(harness, "sk-a").responses.retrieve(response.id)).id == response.id
        other = client(harness, "sk-b")
        for call in (other.responses.retrieve, other.responses.delete, other.responses.input_items.list):
            with pytest.raises(openai.NotFoundError):
                await call(response.id)  # type: ignore[operator]
        assert (await client(harness, "sk-a").responses.retrieve(response.id)).id == response.id


async def test_ids_that_name_no_response_are_404s_and_bad_options_400s(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        for response_id in ("resp_" + "0" * 32, "nonsense", "rec_" + "0" * 32):
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.retrieve(response_id)
        response = await sdk.responses.create(model="fake-model", input="Hi", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="limit"):
            await sdk.responses.input_items.list(response.id, limit=1000)
        with pytest.raises(openai.BadRequestError, match="not streamed"):
            await sdk.responses.retrieve(response.id, stream=True)
        status, body = await harness.get(f"/v1/responses/{response.id}?starting_after=x&stream=true")
        assert status == 400 and body["error"]["param"] == "starting_after"
