"""How the proxy behaves when things go wrong: failing, lying or drifting replicas, bad input, broken streams.

Each case answers with an OpenAI-style error that says what to fix, never serves an answer from a stack the
request did not pin, and never leaves a half-written record."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from tests.fake_replica import FakeReplica
from tests.proxy_harness import Harness, running_proxy

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


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
async def test_health_and_readiness(replica: FakeReplica, tmp_path: Path, path: str) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        status, _ = await harness.get(path)
        assert status == 200
        harness.proxy.registry.unreachable("replica-0")
        status, _body = await harness.get(path)
        assert status == (200 if path == "/healthz" else 503)
