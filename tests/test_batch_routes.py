"""The Files and Batch APIs through the official SDK: a file uploaded, a batch created on it for each of the four
routes, polled to its end, its output and error files read; every line a record of the log and the batch's own
entry naming them; cancelling; the limits on uploads and input lines; tenants that see only their own."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.state.batches import batch_record_id
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

FAST_JOBS = {"poll_interval_s": 0.05}


def client(harness: Harness, key: str = "unused-on-loopback") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=harness.v1, api_key=key, max_retries=0)


def jsonl(url: str, bodies: list[dict[str, Any]]) -> bytes:
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": url, "body": b} for i, b in enumerate(bodies)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def finished(sdk: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 20.0) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                return batch
            await asyncio.sleep(0.05)


def read_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


BODIES = {
    "/v1/chat/completions": {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
    },
    "/v1/completions": {"model": "fake-model", "prompt": "Once", "max_tokens": 3},
    "/v1/responses": {"model": "fake-model", "input": "Hello", "max_output_tokens": 3},
    "/v1/embeddings": {"model": "fake-model", "input": ["a", "b"]},
}


@pytest.mark.parametrize("url", list(BODIES))
async def test_a_batch_answers_every_line_through_the_serving_path_each_a_record(
    replica: FakeReplica, tmp_path: Path, url: str
) -> None:
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS) as harness:
        sdk = client(harness)
        unmatched = {**BODIES[url], "stackpin": {"kernel_mode": "default"}}  # no such stack: an error line
        content = jsonl(url, [BODIES[url], BODIES[url], unmatched, BODIES[url]])
        uploaded = await sdk.files.create(file=("requests.jsonl", content), purpose="batch")
        assert (uploaded.purpose, uploaded.bytes) == ("batch", len(content))
        assert (await sdk.files.content(uploaded.id)).content == content
        created = await sdk.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h",  # type: ignore[arg-type]
                                           metadata={"job": "nightly"})  # fmt: skip
        assert created.status in ("validating", "in_progress") and created.request_counts.total == 4  # type: ignore[union-attr]
        batch = await finished(sdk, created.id)
        assert batch.status == "completed" and batch.metadata == {"job": "nightly"}
        assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)  # type: ignore[union-attr]
        assert batch.output_file_id and batch.error_file_id
        output = read_jsonl((await sdk.files.content(batch.output_file_id)).text)
        errors = read_jsonl((await sdk.files.content(batch.error_file_id)).text)
        assert [line["custom_id"] for line in output] == ["line-0", "line-1", "line-3"]
        assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("line-2", 409)]
        store = harness.proxy.store
        for line in output:
            record = await store.get_record(line["response"]["request_id"], "local")
            assert record is not None and record.entries[0].content["endpoint"] == url
            assert record.entries[0].content["belongs_to"]["batch"] == batch.id
            assert line["response"]["body"] == record.entries[0].content["response"], (
                "the record is the answer"
            )
        own = await store.get_record(batch_record_id(batch.id), "local")
        assert own is not None and own.status == "completed"
        named = own.entries[0].content
        assert [line["record"] for line in named["lines"]] == [
            output[0]["response"]["request_id"], output[1]["response"]["request_id"], None,
            output[2]["response"]["request_id"],
        ]  # fmt: skip
        assert named["input_file"]["sha256"] == uploaded.sha256  # type: ignore[attr-defined]
        assert [batch.id] == [b.id async for b in sdk.batches.list()]
        await store.integrate()
        assert (await store.verify()).ok


async def test_a_cancelled_batch_stops_taking_up_lines_and_keeps_the_ones_done(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.answer_delay_s = 0.2
    async with running_proxy([replica], tmp_path, jobs=FAST_JOBS, batches={"concurrency": 1}) as harness:
        sdk = client(harness)
        body = BODIES["/v1/chat/completions"]
        uploaded = await sdk.files.create(
            file=("in.jsonl", jsonl("/v1/chat/completions", [body] * 20)), purpose="batch"
        )
        created = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")  # fmt: skip
        while (await sdk.batches.retrieve(created.id)).request_counts.completed < 2:  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
        assert (await sdk.batches.cancel(created.id)).status == "cancelling"
        batch = await finished(sdk, created.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        done = batch.request_counts.completed  # type: ignore[union-attr]
        assert 2 <= done < 20
        assert len(read_jsonl((await sdk.files.content(batch.output_file_id)).text)) == done  # type: ignore[arg-type]


async def test_uploads_and_batches_are_refused_saying_what_to_fix(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy(
        [replica], tmp_path, batches={"max_file_bytes": 2048, "max_lines": 3}
    ) as harness:
        sdk = client(harness)
        with pytest.raises(
            openai.APIStatusError, match=r"2048 bytes \(\[batches\] max_file_bytes\)"
        ) as raised:
            await sdk.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
        assert raised.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await sdk.files.create(file=("a.jsonl", b"{}"), purpose="fine-tune")
        chat = "/v1/chat/completions"
        bad = {
            b"not json\n": "input line 1: not a JSON object",
            jsonl(chat, [BODIES[chat]] * 4): r"more than 3 requests \(\[batches\] max_lines\)",
            jsonl("/v1/completions", [BODIES[chat]]): "url must be the batch's endpoint",
            jsonl(chat, [{"model": "fake-model"}]): "input line 1: 'messages' must be",
            jsonl(chat, [{**BODIES[chat], "stream": True}]): "neither streamed",
        }
        for content, message in bad.items():
            uploaded = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
            with pytest.raises(openai.BadRequestError, match=message):
                await sdk.batches.create(input_file_id=uploaded.id, endpoint=chat, completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            await sdk.batches.create(input_file_id="file-nothing", endpoint=chat, completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await sdk.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h"
            )
        for missing in ("batch_" + "0" * 32, "nonsense"):
            with pytest.raises(openai.NotFoundError):
                await sdk.batches.retrieve(missing)


async def test_a_tenant_sees_only_its_own_files_and_batches(replica: FakeReplica, tmp_path: Path) -> None:
    tenants = [{"name": "a", "api_key_env": "A_KEY"}, {"name": "b", "api_key_env": "B_KEY"}]
    environ = {"A_KEY": "sk-a", "B_KEY": "sk-b"}
    async with running_proxy(
        [replica], tmp_path, tenants=tenants, environ=environ, jobs=FAST_JOBS
    ) as harness:
        a, b = client(harness, "sk-a"), client(harness, "sk-b")
        chat = "/v1/chat/completions"
        uploaded = await a.files.create(file=("in.jsonl", jsonl(chat, [BODIES[chat]])), purpose="batch")
        batch = await a.batches.create(input_file_id=uploaded.id, endpoint=chat, completion_window="24h")
        for call in (b.files.retrieve, b.files.content, b.batches.retrieve, b.batches.cancel):
            with pytest.raises(openai.NotFoundError):
                await call(batch.id if "batch" in call.__qualname__.lower() else uploaded.id)  # type: ignore[operator]
        with pytest.raises(openai.BadRequestError):
            await b.batches.create(input_file_id=uploaded.id, endpoint=chat, completion_window="24h")
        assert [x.id async for x in b.batches.list()] == [] and (await b.files.list()).data == []
        done = await finished(a, batch.id)
        output = read_jsonl((await a.files.content(done.output_file_id)).text)  # type: ignore[arg-type]
        record = await harness.proxy.store.get_record(output[0]["response"]["request_id"], "a")
        assert record is not None and record.tenant == "a"
        with pytest.raises(openai.NotFoundError):
            await b.files.content(done.output_file_id)  # type: ignore[arg-type]
