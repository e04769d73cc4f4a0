"""The official OpenAI SDK, pointed at the proxy with base_url, works unchanged: plain, streaming, logprobs,
extra_body pins, embeddings, the Responses API (translated for a pinned_backend, forwarded to an upstream that serves
it), models.retrieve, and its error classes map from the proxy's statuses."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.audit.note import parse_signer, parse_vkey
from proxy.audit.receipts import parse_receipt, signed_by
from proxy.commands.cli import main as stackpin
from proxy.config import log_key_file
from tests.support.fake_replica import FakeReplica, decode_embedding
from tests.support.proxy_harness import Harness, running_proxy

MESSAGES = [{"role": "user", "content": "Say something about lighthouses."}]
BODY = {"model": "fake-model", "messages": MESSAGES, "temperature": 0, "max_tokens": 5}


def client(harness: Harness, **kwargs: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key="unused-on-loopback", max_retries=0, **kwargs)  # type: ignore[arg-type]


async def test_plain_chat_completion_carries_record_and_stack(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        raw = await client(harness).chat.completions.with_raw_response.create(
            model="fake-model",
            messages=MESSAGES,
            temperature=0,
            max_tokens=6,  # type: ignore[arg-type]
        )
        completion = raw.parse()
        record_id = raw.headers["Stackpin-Record"]
        assert completion.system_fingerprint == replica.fingerprint == raw.headers["Stackpin-Stack"]
        assert completion.choices[0].message.content
        record = await harness.proxy.store.get_record(record_id, "local")
        assert record is not None, "the record must be committed before the answer reaches the client"
        assert record.fingerprint == replica.fingerprint


async def test_streaming_chat_relays_every_chunk_and_closes_the_record(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        response = await client(harness).chat.completions.with_raw_response.create(
            model="fake-model",
            messages=MESSAGES,
            temperature=0,
            max_tokens=5,
            stream=True,  # type: ignore[arg-type]
        )
        record_id = response.headers["Stackpin-Record"]
        stream = response.parse()
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        expected = replica.completion({"messages": MESSAGES, "temperature": 0, "max_tokens": 5})[2]
        assert "".join(p or "" for p in pieces) == expected
        record = await harness.proxy.store.get_record(record_id, "local")
        assert record is not None
        assert [e.part for e in record.entries] == ["opened", "closed"]
        assert record.status == "complete"


async def test_logprobs_pass_through_as_openai_defines_them(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        completion = await client(harness).chat.completions.create(
            model="fake-model",
            messages=MESSAGES,
            temperature=0,
            max_tokens=3,
            logprobs=True,  # type: ignore[arg-type]
        )
        content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None and len(content) == 3
        assert all(isinstance(item.logprob, float) for item in content)


async def test_extra_body_pin_selects_the_matching_stack(tmp_path: Path) -> None:
    invariant = FakeReplica()
    default = FakeReplica(stack={**invariant.stack, "kernel_mode": "default"})
    for r in (invariant, default):
        await r.start()
    try:
        async with running_proxy([invariant, default], tmp_path) as harness:
            sdk = client(harness)
            for mode, replica in (("default", default), ("batch_invariant", invariant)):
                completion = await sdk.chat.completions.create(
                    model="fake-model",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=2,
                    extra_body={"stackpin": {"kernel_mode": mode}},
                )
                assert completion.system_fingerprint == replica.fingerprint
            assert "stackpin" not in default.requests[-1], "the pin is the proxy's and is never forwarded"
    finally:
        for r in (invariant, default):
            await r.stop()


async def test_legacy_completions_endpoint(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        completion = await client(harness).completions.create(
            model="fake-model", prompt="Once upon a time", max_tokens=4, temperature=0
        )
        assert completion.system_fingerprint == replica.fingerprint
        assert completion.choices[0].text


async def test_unknown_fields_pass_through_untouched(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        await client(harness).chat.completions.create(
            model="fake-model",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"vendor_option": {"nested": [1, 2.5, None]}, "user": "u-17"},
        )
        assert replica.requests[-1]["vendor_option"] == {"nested": [1, 2.5, None]}
        assert replica.requests[-1]["user"] == "u-17"


async def test_models_lists_live_stacks_and_routes(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path, routes={"support": {"model": "fake-model"}}) as harness:
        models = await client(harness).models.list()
        ids = {m.id for m in models.data}
        assert ids == {"fake-model", "support"}


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ({"extra_body": {"stackpin": {"colour": "blue"}}}, openai.BadRequestError),
        ({"extra_body": {"stackpin": {"kernel_mode": "nonexistent"}}}, openai.ConflictError),
        ({"model": "no-such-model"}, openai.NotFoundError),
        ({"extra_body": {"stackpin": {"prompt": "support@9"}}}, openai.BadRequestError),
    ],
)
async def test_errors_map_to_the_sdk_classes(
    replica: FakeReplica, tmp_path: Path, call: dict[str, object], error: type[Exception]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        kwargs: dict[str, object] = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 2, **call}
        with pytest.raises(error) as raised:
            await client(harness).chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert raised.value.body and "message" in raised.value.body  # type: ignore[attr-defined]


async def test_a_model_nothing_serves_is_openais_404_model_not_found_listing_the_live_stacks(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        with pytest.raises(openai.NotFoundError) as raised:
            await client(harness).chat.completions.create(
                model="gpt-nothing", messages=MESSAGES, max_tokens=2
            )
        assert raised.value.code == "model_not_found" and "fake-model" in raised.value.message
        body = raised.value.body
        assert isinstance(body, dict) and body["live_stacks"][0]["fingerprint"] == replica.fingerprint


async def test_no_live_replica_is_a_503_listing_live_stacks(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        harness.proxy.registry.unreachable("replica-0")
        with pytest.raises(openai.InternalServerError) as raised:
            await client(harness).chat.completions.create(
                model="fake-model",
                messages=MESSAGES,
                max_tokens=2,  # type: ignore[arg-type]
            )
        assert raised.value.status_code == 503


async def test_unknown_api_key_is_a_401_and_another_tenants_record_a_404(
    replica: FakeReplica, tmp_path: Path
) -> None:
    tenants = [{"name": "acme", "api_key_env": "ACME_KEY"}, {"name": "globex", "api_key_env": "GLOBEX_KEY"}]
    environ = {"ACME_KEY": "sk-acme-123", "GLOBEX_KEY": "sk-globex-456"}
    async with running_proxy([replica], tmp_path, tenants=tenants, environ=environ) as harness:
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=harness.v1, api_key="sk-wrong", max_retries=0).models.list()
        acme = openai.AsyncOpenAI(base_url=harness.v1, api_key="sk-acme-123", max_retries=0)
        raw = await acme.chat.completions.with_raw_response.create(
            model="fake-model",
            messages=MESSAGES,
            max_tokens=2,  # type: ignore[arg-type]
        )
        record_id = raw.headers["Stackpin-Record"]
        status, _ = await harness.get(
            f"/v1/records/{record_id}", headers={"Authorization": "Bearer sk-globex-456"}
        )
        assert status == 404
        status, record = await harness.get(
            f"/v1/records/{record_id}", headers={"Authorization": "Bearer sk-acme-123"}
        )
        assert status == 200 and record["tenant"] == "acme"


async def test_a_streams_record_is_committed_before_its_first_byte(
    replica: FakeReplica, tmp_path: Path
) -> None:
    import aiohttp

    async with running_proxy([replica], tmp_path) as harness:
        body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 4, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json=body) as r,
        ):
            record = await harness.proxy.store.get_record(r.headers["Stackpin-Record"], "local")
            assert record is not None and record.entries[0].part == "opened"
            await r.read()


async def test_models_retrieve_names_a_live_model_or_a_route_and_404s_anything_else(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, routes={"support": {"model": "fake-model"}}) as harness:
        sdk = client(harness)
        model = await sdk.models.retrieve("fake-model")
        assert (model.id, model.object) == ("fake-model", "model")
        assert model.model_extra is not None and model.model_extra["stacks"] == [replica.fingerprint]
        assert (await sdk.models.retrieve("support")).id == "support"
        with pytest.raises(openai.NotFoundError) as raised:
            await sdk.models.retrieve("gpt-nothing")
        assert "fake-model" in raised.value.message


async def test_a_request_naming_no_model_is_a_400_naming_the_live_ones_unless_a_default_route_serves_it(
    replica: FakeReplica, tmp_path: Path
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2}
    async with running_proxy([replica], tmp_path) as harness:
        status, answer, _ = await harness.post("/v1/chat/completions", body)
        assert status == 400 and answer["error"]["param"] == "model"
        assert "'fake-model'" in answer["error"]["message"]
        status, _, _ = await harness.post(
            "/v1/chat/completions", body, headers={"Stackpin-Pin": f"stack={replica.fingerprint}"}
        )
        assert status == 200, "a pinned stack names its model"
    routes = {"default": {"model": "fake-model"}}
    (tmp_path / "routed").mkdir()
    async with running_proxy(
        [replica], tmp_path / "routed", routes=routes, server={"default_route": "default"}
    ) as harness:
        status, _, headers = await harness.post("/v1/chat/completions", body)
        assert status == 200 and headers["Stackpin-Stack"] == replica.fingerprint
        assert replica.requests[-1]["model"] == "fake-model"


async def replay(harness: Harness, record_id: str) -> dict[str, Any]:
    status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
    assert status == 200, result
    return result


async def test_embeddings_through_the_sdk_are_recorded_whole_and_replay_bit_for_bit(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        # The SDK asks for base64 by default and decodes it.
        raw = await client(harness).embeddings.with_raw_response.create(
            model="fake-model", input=["sea", "sky"]
        )
        result = raw.parse()
        assert [len(d.embedding) for d in result.data] == [8, 8]
        record = await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local")
        assert record is not None and record.entries[0].content["endpoint"] == "/v1/embeddings"
        recorded = record.entries[0].content["response"]["data"]
        assert [decode_embedding(d["embedding"]) for d in recorded] == [d.embedding for d in result.data]
        assert (await replay(harness, record.id))["outcome"] == "reproduced"
        replica.alter = "embedding"
        diverged = await replay(harness, record.id)
        assert (diverged["part"], diverged["field"], diverged["position"]) == ("data[1]", "embedding", 5)


async def test_responses_through_the_sdk_plain_streamed_and_continued_are_recorded_expanded_and_replay(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        sdk = client(harness)
        raw = await sdk.responses.with_raw_response.create(
            model="fake-model",
            input="Tell me of the sea.",
            instructions="Be brief.",
            max_output_tokens=5,
            temperature=0,
        )
        first = raw.parse()
        record_id = raw.headers["Stackpin-Record"]
        assert first.id == "resp_" + record_id.removeprefix("rec_")
        assert first.output_text == replica.completion(replica.requests[-1])[2]
        assert first.status == "incomplete" and first.usage is not None and first.usage.output_tokens == 5
        assert replica.requests[-1]["messages"][0] == {"role": "system", "content": "Be brief."}, (
            "translated to chat"
        )
        assert (await replay(harness, record_id))["outcome"] == "reproduced"

        stream = await sdk.responses.create(
            model="fake-model", input="And the sky?", previous_response_id=first.id, max_output_tokens=4,
            temperature=0, stream=True,
        )  # fmt: skip
        received = [event async for event in stream]
        events = [event.type for event in received]
        final = received[-1].response  # type: ignore[union-attr]
        assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added"]  # fmt: skip
        assert events[-1] == "response.incomplete" and "response.output_text.delta" in events
        assert final.previous_response_id == first.id
        sent = replica.requests[-1]["messages"]
        assert [m["content"] for m in sent] == ["Tell me of the sea.", first.output_text, "And the sky?"], (
            "the previous turn is expanded; its instructions are not carried over"
        )
        continued = await harness.proxy.store.get_record("rec_" + final.id.removeprefix("resp_"), "local")
        assert continued is not None
        opened = continued.entries[0].content
        assert opened["continues"] == record_id and "previous_response_id" not in opened["translated_from"]
        assert len(opened["translated_from"]["input"]) == 3, (
            "the record holds the whole input, not just an id"
        )
        assert (await replay(harness, continued.id))["outcome"] == "reproduced"
        replica.alter = "chunk_split"
        diverged = await replay(harness, continued.id)
        assert diverged["outcome"] == "diverged" and diverged["field"] == "delta" and diverged["event"] == 6
        with pytest.raises(openai.BadRequestError) as raised:
            await sdk.responses.create(model="fake-model", input="x", previous_response_id="resp_" + "0" * 32)
        assert raised.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_an_upstream_that_serves_the_responses_api_gets_it_forwarded_under_the_records_id(
    replica: FakeReplica, tmp_path: Path
) -> None:
    upstream = {"name": "upstream", "url": replica.url, "stack": {"model": "fake-model"},
                "endpoints": ["/v1/chat/completions", "/v1/responses"]}  # fmt: skip
    async with running_proxy([], tmp_path, replicas=[upstream]) as harness:
        sdk = client(harness)
        raw = await sdk.responses.with_raw_response.create(
            model="fake-model", input="hello", max_output_tokens=3, temperature=0
        )
        response = raw.parse()
        assert "input" in replica.requests[-1] and "messages" not in replica.requests[-1], (
            "forwarded, not translated"
        )
        assert response.id == "resp_" + raw.headers["Stackpin-Record"].removeprefix("rec_")
        record = await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local")
        assert record is not None and record.entries[0].content["upstream"]["id"].startswith("resp_upstream")
        result = await replay(harness, record.id)
        assert result["outcome"] == "reproduced", json.dumps(result)
        stream = await sdk.responses.create(
            model="fake-model", input="hello", max_output_tokens=3, stream=True
        )
        names = [event.type async for event in stream]
        assert names[0] == "response.created" and names[-1] == "response.completed"
        with pytest.raises(openai.ConflictError) as raised:
            await sdk.embeddings.create(model="fake-model", input="x")
        assert "serves /v1/embeddings" in raised.value.message


def _log_key(harness: Harness) -> str:
    """The verifier key of the log the harness's proxy made itself (the embedded default's key file)."""
    path = log_key_file(harness.settings)
    assert path is not None
    return parse_signer(path.read_text()).verifier.vkey


async def test_a_client_keeps_the_answers_receipt_and_proves_it_later_without_trusting_the_proxy(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        raw = await client(harness).chat.completions.with_raw_response.create(
            model="fake-model", messages=MESSAGES, temperature=0, max_tokens=4
        )
        raw.parse()
        kept = tmp_path / "receipts" / raw.headers["Stackpin-Record"]
        kept.parent.mkdir()
        kept.write_text(raw.headers["Stackpin-Receipt"])
        vkey = _log_key(harness)
        receipt = parse_receipt(kept.read_text())
        assert receipt.record_id == raw.headers["Stackpin-Record"] and receipt.part == "answer"
        assert receipt.fingerprint == raw.headers["Stackpin-Stack"] == replica.fingerprint
        signed_by(receipt, [parse_vkey(vkey)])
        await harness.proxy.store.integrate()
        prove = ["prove", "--receipt", str(kept), "--url", harness.url, "--log-key", vkey]
        assert await asyncio.to_thread(stackpin, prove) == 0
        assert "PROVEN: leaf 0 of the tree" in capsys.readouterr().out
        store = ["--config", str(_config(tmp_path, harness)), "--log-key", vkey]
        assert await asyncio.to_thread(stackpin, ["verify", *store, "--receipt", str(kept.parent)]) == 0
        assert "receipts given: 1 of 1 fulfilled" in capsys.readouterr().out


def _config(folder: Path, harness: Harness) -> Path:
    path = folder / "stackpin.toml"
    path.write_text(f'[store]\nurl = "{harness.settings.store.url}"\n')
    return path


async def test_a_stream_carries_its_opened_entrys_receipt_in_its_headers_and_its_closed_entrys_before_its_end(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        raw = await client(harness).chat.completions.with_raw_response.create(
            model="fake-model", messages=MESSAGES, temperature=0, max_tokens=5, stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in raw.parse() if chunk.choices]
        assert "".join(p or "" for p in pieces), "the SDK reads the stream, the receipt's comment skipped"
        record = await harness.proxy.store.get_record(raw.headers["Stackpin-Record"], "local")
        assert record is not None
        opened, closed = record.entries
        assert raw.headers["Stackpin-Receipt"] == opened.receipt
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json={**BODY, "stream": True}) as response,
        ):
            read = (await response.read()).decode()
        record = await harness.proxy.store.get_record(response.headers["Stackpin-Record"], "local")
        assert record is not None
        closed = record.entries[-1]
        assert read.endswith(f"\n\n: Stackpin-Receipt {closed.receipt}\n\ndata: [DONE]\n\n")
        assert parse_receipt(closed.receipt or "").part == "closed"
