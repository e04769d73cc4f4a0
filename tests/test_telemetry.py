"""OpenTelemetry (proxy/telemetry.py): one span per answer, sent over OTLP/HTTP to a real receiver on loopback that
decodes the protobuf with the protocol's own code, carrying the GenAI conventions and the stack that answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from proxy.audit import StoredEntry
from proxy.pins import Pin
from proxy.replicas.kinds import UPSTREAM
from proxy.replicas.registry import ReplicaSnapshot
from proxy.serving.records import Served
from proxy.stack import Stack
from proxy.telemetry import NoTelemetry, OtlpTelemetry, answer_attributes
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
}


class Receiver:
    """An OTLP/HTTP traces endpoint: what a collector (Tempo, Jaeger, Langfuse) is sent."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], ExportTraceServiceRequest]] = []

    async def traces(self, request: web.Request) -> web.Response:
        decoded = ExportTraceServiceRequest()
        decoded.ParseFromString(await request.read())
        self.requests.append((dict(request.headers), decoded))
        return web.Response(body=b"", content_type="application/x-protobuf")

    def spans(self) -> list[tuple[dict[str, Any], Span]]:
        """Each span with its resource's attributes."""
        return [
            (_attributes(resource.resource.attributes), span)
            for _, sent in self.requests
            for resource in sent.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    listening = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", listening.traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield listening, f"http://127.0.0.1:{port}/v1/traces"
    finally:
        await runner.cleanup()


async def test_each_answer_is_one_span_with_the_genai_conventions_and_the_stack_that_answered(
    replica: FakeReplica, tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    listening, endpoint = receiver
    telemetry = {"otlp_endpoint": endpoint, "service_name": "stackpin-test", "headers_env": "OTLP_HEADERS"}
    environ = {"OTLP_HEADERS": "Authorization=Basic c2VjcmV0, x-scope=tests"}
    async with running_proxy([replica], tmp_path, telemetry=telemetry, environ=environ) as harness:
        _, body, headers = await harness.post("/v1/chat/completions", CHAT)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            await response.read()
            streamed = response.headers["Stackpin-Record"]
        exporter = harness.proxy.telemetry
        assert isinstance(exporter, OtlpTelemetry)
        assert await asyncio.to_thread(exporter.flush), "exported to the receiver"
        answered = await harness.proxy.store.get_record(headers["Stackpin-Record"], None)
    assert answered is not None
    sent_headers = listening.requests[0][0]
    assert sent_headers["Content-Type"] == "application/x-protobuf"
    assert sent_headers["Authorization"] == "Basic c2VjcmV0" and sent_headers["x-scope"] == "tests"
    spans = {
        (_attributes(span.attributes))["stackpin.record.id"]: (resource, span)
        for resource, span in listening.spans()
    }
    assert set(spans) == {headers["Stackpin-Record"], streamed}, "one span per answer"
    resource, span = spans[headers["Stackpin-Record"]]
    attributes = _attributes(span.attributes)
    assert resource["service.name"] == "stackpin-test"
    assert span.name == "chat fake-model" and span.kind == Span.SPAN_KIND_CLIENT
    assert span.start_time_unix_nano < span.end_time_unix_nano
    stack = replica.stack
    assert attributes | {"server.port": 0} == attributes | {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "stackpin",
        "gen_ai.request.model": "fake-model",
        "gen_ai.request.max_tokens": 4,
        "gen_ai.request.temperature": 0,
        "gen_ai.response.model": body["model"],
        "gen_ai.response.id": body["id"],
        "gen_ai.response.finish_reasons": [body["choices"][0]["finish_reason"]],
        "gen_ai.usage.input_tokens": body["usage"]["prompt_tokens"],
        "gen_ai.usage.output_tokens": body["usage"]["completion_tokens"],
        "server.address": "127.0.0.1",
        "server.port": 0,
        "stackpin.stack.fingerprint": replica.fingerprint,
        "stackpin.stack.weights_sha256": stack["weights_sha256"],
        "stackpin.stack.quantisation": stack["quantisation"],
        "stackpin.stack.hardware": stack["hardware"],
        "stackpin.stack.kernel_mode": stack["kernel_mode"],
        "stackpin.stack.declared": False,
        "stackpin.stack.source": "proven",
        "stackpin.replica": "replica-0",
        "stackpin.tenant": "local",
        "stackpin.stream": False,
        "stackpin.status": "complete",
        "stackpin.log.seq": answered.entries[0].seq,
    }
    assert "hi" not in str(attributes.values()), "never the prompt or the answer: those are the record's"
    _, stream_span = spans[streamed]
    assert _attributes(stream_span.attributes)["stackpin.stream"] is True


async def test_without_an_endpoint_there_is_no_exporter_and_no_span(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        assert isinstance(harness.proxy.telemetry, NoTelemetry)
        status, _, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200


def test_a_responses_answer_names_its_usage_and_status_and_an_interrupted_stream_says_so() -> None:
    replica = FakeReplica()
    snapshot = ReplicaSnapshot("replica-0", "http://10.0.0.5:8000", UPSTREAM, Stack.model_validate(replica.stack),
                               replica.fingerprint, None)  # fmt: skip
    served = Served("rec_1", "acme", "/v1/responses", Pin(), None, None, snapshot, {"model": "chat-x"},
                    datetime(2026, 12, 1, tzinfo=UTC), translated_from={"model": "fake-model", "stop": "\n"})  # fmt: skip
    stored = StoredEntry(record_id="rec_1", part="closed", seq=9, sha256="ab" * 32, leaf_hash="cd" * 32,
                         created_at=datetime(2026, 12, 1, tzinfo=UTC))  # fmt: skip
    body = {
        "id": "resp_1",
        "model": "fake-model",
        "status": "incomplete",
        "usage": {"input_tokens": 5, "output_tokens": 2},
    }
    attributes = answer_attributes(served, body, stored, "interrupted")
    assert attributes["gen_ai.request.model"] == "fake-model", "the client's request, not its translation"
    assert attributes["gen_ai.request.stop_sequences"] == ["\n"]
    assert attributes["gen_ai.response.finish_reasons"] == ["incomplete"]
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (5, 2)
    assert attributes["stackpin.stack.declared"] is True and attributes["stackpin.stream"] is True
    assert attributes["stackpin.stack.source"] == "declared"
    assert (attributes["server.address"], attributes["server.port"]) == ("10.0.0.5", 8000)
    assert attributes["stackpin.status"] == "interrupted" and attributes["stackpin.log.seq"] == 9
