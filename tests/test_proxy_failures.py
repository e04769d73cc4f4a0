"""How the proxy behaves when things go wrong: failing, lying or drifting replicas, bad input, broken streams.

Each case answers with an OpenAI-style error that says what to fix, never serves an answer from a stack the
request did not pin, and never leaves a half-written record."""

from __future__ import annotations

import asyncio
import io
import json
import sqlite3
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy.engine import make_url

from proxy.app import create_app
from proxy.config import resolve_secrets
from proxy.logs import configure_logging
from proxy.process.listener import bind, serving
from tests.support.audit_databases import KINDS, LOG_KEY_ENV, LOG_SIGNER, POSTGRES_URL, audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy, settings_for
from tests.support.tcp_relay import TcpRelay

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
    "temperature": 0,
}


async def record_count(harness: Harness) -> int:
    return len(await harness.proxy.store.list_records(limit=1000))


async def test_a_failing_replica_is_retried_on_a_twin_of_the_identical_fingerprint(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    other_stack = FakeReplica(stack={**replica.stack, "quantisation": "bf16"})
    await other_stack.start()
    try:
        async with running_proxy([replica, twin, other_stack], tmp_path) as harness:
            replica.failure = "500"
            harness.proxy.registry.acquire("replica-1")  # make replica-0 the first choice
            status, _body, headers = await harness.post(
                "/v1/chat/completions", {**CHAT, "model": "fake-model"}
            )
            # The pin (model only) matches both stacks; the first choice's fingerprint bounds the retry.
            assert status == 200
            assert headers["Stackpin-Stack"] == replica.fingerprint
            assert len(replica.requests) == 1 and len(twin.requests) == 1 and not other_stack.requests
            assert harness.proxy.registry.get("replica-0").in_rotation, "a replica that answered 500 stays in"  # type: ignore[union-attr]
    finally:
        await other_stack.stop()


async def test_when_every_identical_replica_fails_the_request_fails_rather_than_drift(
    replica: FakeReplica, tmp_path: Path
) -> None:
    other_stack = FakeReplica(stack={**replica.stack, "quantisation": "bf16"})
    await other_stack.start()
    try:
        async with running_proxy([replica, other_stack], tmp_path) as harness:
            replica.failure = "500"
            harness.proxy.registry.acquire("replica-1")
            status, body, _ = await harness.post("/v1/chat/completions", CHAT)
            assert status == 502
            assert "every replica of stack" in body["error"]["message"]
            assert not other_stack.requests
            assert await record_count(harness) == 0
    finally:
        await other_stack.stop()


async def test_a_replica_that_cannot_be_reached_leaves_rotation_until_it_answers_again(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica, twin], tmp_path) as harness:
        harness.proxy.registry.acquire("replica-1")
        await replica.stop()
        status, _, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200 and len(twin.requests) == 1
        assert not harness.proxy.registry.get("replica-0").in_rotation  # type: ignore[union-attr]
        await replica.start(port=int(replica.url.rsplit(":", 1)[1]))
        await harness.proxy.health.check_all()
        assert harness.proxy.registry.get("replica-0").in_rotation  # type: ignore[union-attr]


async def test_garbage_from_a_replica_is_a_502_and_records_nothing(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        replica.failure = "garbage"
        status, body, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 502
        assert "not an OpenAI response" in body["error"]["message"]
        assert await record_count(harness) == 0


async def test_an_answer_the_log_cannot_hold_is_not_served(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        replica.failure = "unsafe_int"
        status, body, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 502 and "cannot be recorded" in body["error"]["message"]
        assert await record_count(harness) == 0
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            record_id = response.headers["Stackpin-Record"]
            await response.read()
        record = await harness.proxy.store.get_record(record_id, "local")
        assert record is not None and record.status == "interrupted"
        assert "cannot be recorded" in record.entries[-1].content["error"]


async def test_an_answer_under_another_fingerprint_quarantines_the_replica_and_flags_its_records(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica, twin], tmp_path) as harness:
        harness.proxy.registry.acquire("replica-1")
        status, _, first = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200 and first["Stackpin-Stack"] == replica.fingerprint
        replica.failure = "wrong_fingerprint"
        status, _, _headers = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200, "the twin of the identical stack serves instead"
        assert len(twin.requests) == 1
        assert harness.proxy.registry.get("replica-0").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]
        flagged = await harness.proxy.store.get_record(first["Stackpin-Record"], None)
        assert flagged is not None and flagged.flags, "records since the last good check are marked"


async def test_a_stack_that_changes_under_a_replica_takes_it_out_of_rotation(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        _, _, before = await harness.post("/v1/chat/completions", CHAT)
        replica.stack = {**replica.stack, "weights_sha256": "cd" * 32}
        await harness.proxy.health.check_all()
        status, _body, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 503
        record = await harness.proxy.store.get_record(before["Stackpin-Record"], None)
        assert record is not None and record.flags[0].status == "stack_changed"
        async with aiohttp.ClientSession() as session, session.get(f"{harness.url}/metrics") as response:
            metrics = await response.text()
        assert 'stackpin_quarantines_total{reason="stack_changed",replica="replica-0"} 1.0' in metrics
        assert 'stackpin_records_marked_total{reason="stack_changed"} 1.0' in metrics


async def test_malformed_json_wrong_types_and_oversized_bodies_are_400s_and_413s(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, server={"max_body_bytes": 4096}) as harness:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{harness.v1}/chat/completions", data=b"{not json") as response:
                assert response.status == 400
                assert "not valid JSON" in (await response.json())["error"]["message"]
            async with session.post(f"{harness.v1}/chat/completions", data=b"x" * 10_000) as response:
                assert response.status == 413
                assert "max_body_bytes" in (await response.json())["error"]["message"]
        for body, param in [
            ({**CHAT, "messages": "hi"}, "messages"),
            ({**CHAT, "stream": "yes"}, "stream"),
            ({**CHAT, "model": 7}, "model"),
        ]:
            status, answer, _ = await harness.post("/v1/chat/completions", body)
            assert status == 400 and answer["error"]["param"] == param
        status, answer, _ = await harness.post(
            "/v1/chat/completions", CHAT, headers={"Stackpin-Pin": "model"}
        )
        assert status == 400 and "key=value" in answer["error"]["message"]
        status, answer, _ = await harness.post(
            "/v1/chat/completions", CHAT, headers={"Stackpin-Pin": "kernel_mode=default"}
        )
        assert status == 409 and answer["error"]["live_stacks"][0]["fingerprint"] == replica.fingerprint
        assert await record_count(harness) == 0


async def test_a_request_the_log_cannot_hold_is_refused_naming_the_field_before_any_replica_sees_it(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        for raw, param in [
            (json.dumps({**CHAT, "seed": 2**63 - 1}), "seed"),
            (json.dumps(CHAT)[:-1] + ', "top_p": 1e400}', "top_p"),
            (
                json.dumps({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}),
                "messages[0].content",
            ),
            (
                json.dumps({**CHAT, "tools": [{"a": [[[[]]]]}] * 2}).replace("[[[[]]]]", "[" * 70 + "]" * 70),
                None,
            ),
        ]:
            for stream in (False, True):
                body = raw.replace('"temperature": 0', f'"temperature": 0, "stream": {json.dumps(stream)}')
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(f"{harness.v1}/chat/completions", data=body) as response,
                ):
                    answer = await response.json()
                    assert response.status == 400, answer
                if param is not None:
                    assert answer["error"]["param"] == param
                else:
                    assert "64 levels" in answer["error"]["message"]
        assert not replica.requests, (
            "no replica is called (nor billed) for an answer that could not be served"
        )
        assert await record_count(harness) == 0


async def test_a_replica_rejection_passes_through_with_its_message(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        status, body, _ = await harness.post("/v1/chat/completions", {**CHAT, "max_tokens": -1})
        assert status == 400 and "max_tokens" in body["error"]["message"]
        assert await record_count(harness) == 0


async def test_unknown_record_and_route_are_404s(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        status, body = await harness.get("/v1/records/rec_nope")
        assert status == 404 and "stackpin records" in body["error"]["message"]
        status, body = await harness.get("/v1/nothing-here")
        assert status == 404 and "error" in body


@pytest.mark.parametrize("store", KINDS)
async def test_a_malformed_record_id_is_a_404_on_either_store(
    store: str, replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, store=store) as harness:
        for path in ("/v1/records/rec_0%00", "/v1/records/rec_0%00/proof", "/v1/records/" + "r" * 101):
            status, body = await harness.get(path)
            assert status == 404, (path, status, body)
            assert "rec_<32 hex>" in body["error"]["message"]
        status, body, _ = await harness.post("/v1/records/rec_0%00/replay", {})
        assert status == 404, body


async def test_a_stream_the_replica_breaks_off_is_recorded_as_interrupted(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        replica.failure = "drop_stream"
        events = []
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{harness.v1}/chat/completions", json={**CHAT, "max_tokens": 6, "stream": True}
            ) as response,
        ):
            record_id = response.headers["Stackpin-Record"]
            async for line in response.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
        assert b"[DONE]" not in events, "a broken stream must not look complete"
        assert "error" in json.loads(events[-1])
        record = await harness.proxy.store.get_record(record_id, "local")
        assert record is not None and record.status == "interrupted"


async def test_a_client_that_leaves_mid_stream_leaves_an_interrupted_record(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replica.chunk_delay_s = 0.2
    async with running_proxy([replica], tmp_path) as harness:
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                f"{harness.v1}/chat/completions", json={**CHAT, "max_tokens": 40, "stream": True}
            )
            record_id = response.headers["Stackpin-Record"]
            await response.content.readline()  # the first event, then the client goes away
            response.close()
        for _ in range(100):
            record = await harness.proxy.store.get_record(record_id, "local")
            if record is not None and record.status != "streaming":
                break
            await asyncio.sleep(0.05)
        assert record is not None and [e.part for e in record.entries] == ["opened", "closed"]
        assert record.status == "interrupted"
        assert "client went away" in record.entries[-1].content["error"]


async def test_prompt_versions_inject_the_exact_text_and_record_its_hash(
    replica: FakeReplica, tmp_path: Path
) -> None:
    prompts = {"support@3": "You are a careful support agent.", "support@4": "You are brief."}
    routes = {"support-bot": {"model": "fake-model", "prompt": "support@3"}}
    async with running_proxy([replica], tmp_path, prompts=prompts, routes=routes) as harness:
        status, _, headers = await harness.post("/v1/chat/completions", {**CHAT, "model": "support-bot"})
        assert status == 200
        assert replica.requests[-1]["messages"][0] == {"role": "system", "content": prompts["support@3"]}
        assert replica.requests[-1]["model"] == "fake-model", "a route name is never sent to a replica"
        record = await harness.proxy.store.get_record(headers["Stackpin-Record"], "local")
        assert record is not None and record.prompt_text == prompts["support@3"]
        assert record.entries[0].content["prompt"]["version"] == 3
        status, body, _ = await harness.post(
            "/v1/chat/completions", {**CHAT, "stackpin": {"prompt": "support@7"}}
        )
        assert status == 400 and "support@3" in body["error"]["message"]


async def test_a_cookie_one_answer_sets_is_never_sent_on_another_request(
    replica: FakeReplica, tmp_path: Path
) -> None:
    # Requests of every tenant share the proxy's one HTTP client: a cookie kept from one answer would go out with
    # the next tenant's request, and an upstream could tie the two together.
    replica.set_cookie = "affinity=tenant-a; Path=/"
    replica.url = replica.url.replace(
        "127.0.0.1", "localhost"
    )  # a client keeps no cookie of a bare IP address
    tenants = [{"name": "a", "api_key_env": "A_KEY"}, {"name": "b", "api_key_env": "B_KEY"}]
    environ = {"A_KEY": "sk-a", "B_KEY": "sk-b"}
    async with running_proxy([replica], tmp_path, tenants=tenants, environ=environ) as harness:
        for key in ("sk-a", "sk-b", "sk-a"):
            status, _, _ = await harness.post(
                "/v1/chat/completions", CHAT, headers={"Authorization": f"Bearer {key}"}
            )
            assert status == 200
    assert len(replica.headers_seen) == 3
    assert all("Cookie" not in headers for headers in replica.headers_seen), replica.headers_seen


async def test_secrets_never_reach_a_record(replica: FakeReplica, tmp_path: Path) -> None:
    upstream = {**replica.stack}
    replicas = [{"name": "upstream", "url": replica.url, "api_key_env": "UPSTREAM_KEY", "stack": upstream}]
    tenants = [{"name": "acme", "api_key_env": "ACME_KEY"}]
    environ = {"UPSTREAM_KEY": "sk-upstream-secret", "ACME_KEY": "sk-client-secret"}
    async with running_proxy([], tmp_path, replicas=replicas, tenants=tenants, environ=environ) as harness:
        status, _, headers = await harness.post(
            "/v1/chat/completions", CHAT, headers={"Authorization": "Bearer sk-client-secret"}
        )
        assert status == 200
        assert replica.headers_seen[-1]["Authorization"] == "Bearer sk-upstream-secret"
        record = await harness.proxy.store.get_record(headers["Stackpin-Record"], "acme")
        assert record is not None and record.stack_declared
        dumped = record.model_dump_json()
        assert "sk-upstream-secret" not in dumped and "sk-client-secret" not in dumped


async def test_an_upstream_refusing_the_proxys_key_never_shows_the_client_that_key(
    replica: FakeReplica, tmp_path: Path
) -> None:
    replicas = [
        {"name": "upstream", "url": replica.url, "api_key_env": "UP", "stack": {"model": "fake-model"}}
    ]
    async with running_proxy(
        [], tmp_path, replicas=replicas, environ={"UP": "sk-upstream-secret"}
    ) as harness:
        replica.failure = "401"
        status, body, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 502 and "credentials" in body["error"]["message"]
        assert "sk-upstream-secret" not in json.dumps(body)


ECHOED_KEY = "sk-upstream-echoed-0123456789abcdef"


def echoing_upstream(replica: FakeReplica) -> dict[str, object]:
    return {"name": "upstream", "url": replica.url, "api_key_env": "UP", "stack": {"model": "fake-model"}}


async def post_raw(harness: Harness, body: dict[str, object]) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{harness.v1}/chat/completions", json=body) as response,
    ):
        return response.status, (await response.read()).decode()


def assert_openai_error(text: str) -> dict[str, object]:
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str) and isinstance(error["type"], str), text
    assert {"param", "code"} <= set(error), text
    return error


async def test_an_upstream_that_quotes_its_key_in_an_error_never_shows_the_client_that_key(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy(
        [], tmp_path, replicas=[echoing_upstream(replica)], environ={"UP": ECHOED_KEY}
    ) as harness:
        replica.failure = "echo_key"
        for status in (400, 404, 409, 413, 422, 429):
            replica.echo_status = status
            for stream in (False, True):
                answered, text = await post_raw(harness, {**CHAT, "stream": stream})
                assert answered == status, "the upstream's status passes through"
                assert ECHOED_KEY not in text and "[redacted]" in text
                error = assert_openai_error(text)
                assert "check it" in str(error["message"]), (
                    "the rest of the upstream's message passes through"
                )
        assert len(replica.requests) == 12 and await record_count(harness) == 0


async def test_an_upstream_that_quotes_its_key_mid_stream_or_in_garbage_never_shows_it(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy(
        [], tmp_path, replicas=[echoing_upstream(replica)], environ={"UP": ECHOED_KEY}
    ) as harness:
        replica.failure = "echo_key_garbage"
        status, text = await post_raw(harness, CHAT)
        assert status == 502 and ECHOED_KEY[:12] not in text, "not even the start of the key"
        assert_openai_error(text)
        for failure in ("echo_key_garbage", "echo_key_midstream"):
            replica.failure = failure
            status, text = await post_raw(harness, {**CHAT, "stream": True})
            assert status == 200 and ECHOED_KEY[:12] not in text
            events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in events and "error" in json.loads(events[-1])
        assert "[redacted]" in text, "the upstream's error event is relayed, without the key"
        for record in await harness.proxy.store.list_records(limit=10):
            full = await harness.proxy.store.get_record(record.id, None)
            assert full is not None and ECHOED_KEY[:12] not in full.model_dump_json()


async def test_errors_are_counted_by_route_template_so_metrics_hold_no_ids(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        missing = [f"rec_{uuid.uuid4().hex}" for _ in range(40)]
        for record_id in missing:
            status, _ = await harness.get(f"/v1/records/{record_id}")
            assert status == 404
        for _ in range(10):
            status, _ = await harness.get(f"/v1/{uuid.uuid4().hex}")
            assert status == 404
        async with aiohttp.ClientSession() as session, session.get(f"{harness.url}/metrics") as response:
            metrics = await response.text()
    errors = [line for line in metrics.splitlines() if line.startswith("stackpin_request_errors_total{")]
    assert not any(record_id in metrics for record_id in missing), "record ids are not for every scraper"
    assert any('endpoint="/v1/records/{record_id}"' in line and line.endswith(" 40.0") for line in errors)
    assert any('endpoint="unmatched"' in line and line.endswith(" 10.0") for line in errors)
    assert len(errors) == 2, "one series per route and error, however many requests"


async def read_stream(
    harness: Harness, body: dict[str, object], opened: asyncio.Event | None = None
) -> tuple[str, list[str]]:
    """A stream read to its clean end (an aiohttp client hangs or fails on a broken chunked body); `opened` is set
    once its headers have come, which is after its `opened` record was committed."""
    async with (
        asyncio.timeout(60),
        aiohttp.ClientSession() as session,
        session.post(f"{harness.v1}/chat/completions", json=body) as response,
    ):
        assert response.status == 200
        if opened is not None:
            opened.set()
        raw = (await response.read()).decode()
        assert "HTTP/1.1" not in raw, "no second response inside the body"
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        return response.headers["Stackpin-Record"], events


@pytest.mark.postgres
async def test_a_store_outage_is_503s_with_retry_after_a_bounded_log_and_recovery_by_itself(
    replica: FakeReplica, tmp_path: Path
) -> None:
    postgres = make_url(POSTGRES_URL)
    relay = TcpRelay(postgres.host or "127.0.0.1", postgres.port or 5432)
    await relay.start()

    def through_relay(url: str) -> str:
        return url.replace(f"{postgres.host}:{postgres.port}", f"127.0.0.1:{relay.listen_port}")

    sink = io.StringIO()
    configure_logging("info", sink)
    answered: list[str] = []
    try:
        async with running_proxy([replica], tmp_path, store="postgres", store_url=through_relay) as harness:
            for _ in range(3):
                status, _, headers = await harness.post("/v1/chat/completions", CHAT)
                assert status == 200
                answered.append(headers["Stackpin-Record"])
            replica.chunk_delay_s = 0.05
            opened = asyncio.Event()
            long_stream = asyncio.create_task(
                read_stream(harness, {**CHAT, "max_tokens": 30, "stream": True}, opened)
            )
            await asyncio.wait_for(opened.wait(), 30)  # the stream is open and relaying
            await relay.cut()

            async def refused(stream: bool) -> None:
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(
                        f"{harness.v1}/chat/completions", json={**CHAT, "stream": stream}
                    ) as response,
                ):
                    text = (await response.read()).decode()
                    assert response.status == 503 and response.headers["Retry-After"] == "1", text
                    assert "Stackpin-Record" not in response.headers, "no answer without its record"
                    assert assert_openai_error(text)["type"] == "audit_store_unavailable"

            await asyncio.gather(*(refused(stream=i % 4 == 0) for i in range(24)))
            status, body = await harness.get(f"/v1/records/{answered[0]}")
            assert status == 503 and body["error"]["type"] == "audit_store_unavailable"
            status, _ = await harness.get("/readyz")
            assert status == 503
            async with aiohttp.ClientSession() as session, session.get(f"{harness.url}/ui/") as response:
                assert response.status == 503, "the audit page says so too"

            record_id, events = await long_stream
            assert "[DONE]" not in events, "its end is not recorded, so it is not confirmed"
            assert json.loads(events[-1])["error"]["type"] == "audit_store_unavailable"

            await relay.start()
            loop = asyncio.get_running_loop()
            back_at = loop.time()
            while True:
                status, _, headers = await harness.post("/v1/chat/completions", CHAT)
                if status == 200:
                    answered.append(headers["Stackpin-Record"])
                    break
                assert loop.time() - back_at < 10, "the proxy recovers by itself"
                await asyncio.sleep(0.05)
            for record in answered:
                assert await harness.proxy.store.get_record(record, "local") is not None
            listed = {r.id for r in await harness.proxy.store.list_records(limit=1000)}
            assert listed == {*answered, record_id}, "every answer has its record, and nothing else has one"
            stream_record = await harness.proxy.store.get_record(record_id, "local")
            while stream_record is not None and stream_record.status == "streaming":
                assert loop.time() - back_at < 10, "the stream's end is recorded once the store is back"
                await asyncio.sleep(0.05)
                stream_record = await harness.proxy.store.get_record(record_id, "local")
            assert stream_record is not None and stream_record.status == "interrupted"
            closed = stream_record.entries[-1].content
            sent = "".join(closed["events"]) + closed["terminal"]
            assert [line[6:] for line in sent.splitlines() if line.startswith("data: ")] == events, (
                "the record holds what the client read, the failure event in place of the end"
            )
            assert (await harness.proxy.store.verify()).ok
    finally:
        configure_logging("info", sys.stderr)
        await relay.close()
    lines = sink.getvalue().splitlines()
    failed_batches = [line for line in lines if '"audit_batch_failed"' in line]
    assert 1 <= len(failed_batches) <= 26, "one line per failed batch"
    assert max(len(line) for line in lines) < 2000, "no line carries a growing traceback"
    assert "Traceback" not in sink.getvalue(), [line[:300] for line in lines if "Traceback" in line]


@pytest.mark.postgres
async def test_a_stream_the_store_was_away_for_at_its_end_is_closed_at_a_graceful_stop(
    replica: FakeReplica, tmp_path: Path
) -> None:
    postgres = make_url(POSTGRES_URL)
    relay = TcpRelay(postgres.host or "127.0.0.1", postgres.port or 5432)
    await relay.start()
    through_relay = f"127.0.0.1:{relay.listen_port}"
    try:
        async with audit_database("postgres", tmp_path) as database:
            await database.migrate()
            settings = settings_for(
                [replica],
                database.url.replace(f"{postgres.host}:{postgres.port}", through_relay),
                database.schema,
            )
            secrets = resolve_secrets(settings, {LOG_KEY_ENV: LOG_SIGNER.text})
            app = create_app(settings, secrets)
            sock = bind("127.0.0.1", 0)
            try:
                async with serving(app, sock, settings.server) as url:
                    harness = Harness(url, app, settings, secrets)
                    replica.chunk_delay_s = 0.05
                    opened = asyncio.Event()
                    stream = asyncio.create_task(
                        read_stream(harness, {**CHAT, "max_tokens": 20, "stream": True}, opened)
                    )
                    await asyncio.wait_for(opened.wait(), 30)
                    await relay.cut()
                    record_id, events = await stream
                    assert "[DONE]" not in events
                    await relay.start()  # the store is back, and the proxy stops at once
            finally:
                sock.close()
            store = await database.open(signer=None)
            try:
                record = await store.get_record(record_id, None)
                counts = await store.stream_counts()
            finally:
                await store.close()
    finally:
        await relay.close()
    assert record is not None and record.status == "interrupted", (
        "closed by the stop, not left to the next start"
    )
    assert counts.open == 0


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_health_and_readiness(replica: FakeReplica, tmp_path: Path, path: str) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        status, _ = await harness.get(path)
        assert status == 200
        harness.proxy.registry.unreachable("replica-0")
        status, _body = await harness.get(path)
        assert status == (200 if path == "/healthz" else 503)


async def test_a_diverged_log_makes_the_proxy_not_ready_and_says_why_while_answers_are_still_recorded(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path, log={"checkpoint_interval_s": 0.05}) as harness:
        status, _, _ = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200
        await harness.proxy.store.integrate()
        database = make_url(harness.settings.store.url).database
        assert database is not None

        def tamper() -> None:  # the tree's one leaf, changed behind the log's back
            with sqlite3.connect(database, timeout=60) as connection:
                connection.execute(f"UPDATE log_leaves SET leaf_hash = '{'0' * 64}'")

        # On a thread: the proxy signs a checkpoint every 0.05 s, and a write transaction it has open finishes only
        # on this event loop, which a blocking wait for the lock here would hold.
        await asyncio.to_thread(tamper)
        status, _, headers = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200, "an answer is still given: it is committed, though not provable until a repair"
        deadline = asyncio.get_running_loop().time() + 30
        while (ready := await harness.get("/readyz"))[0] == 200:
            assert asyncio.get_running_loop().time() < deadline, "the divergence never showed"
            await asyncio.sleep(0.05)
        status, body = ready
        assert status == 503 and any("audit log diverged" in problem for problem in body["problems"]), body
        assert await harness.proxy.store.get_record(headers["Stackpin-Record"], None) is not None
        async with aiohttp.ClientSession() as session, session.get(harness.url + "/metrics") as response:
            assert "stackpin_audit_log_diverged 1.0" in await response.text()
