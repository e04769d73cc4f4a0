"""Replay: the exact request resent to the identical stack, streamed if the original was, and every part of the
answer compared (tokens and logprob bits, each choice, tool calls, a stream's events); recorded and linked to its
original; over HTTP and through `stackpin replay` with meaningful exit codes, for answers the official OpenAI SDK
received."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from proxy.audit import seal
from proxy.audit.entries import load_canonical
from proxy.commands.cli import main as stackpin
from proxy.pins import Pin
from proxy.serving.records import Served, closed_entry, opened_entry
from tests.support.audit_databases import KINDS
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import Harness, running_proxy

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "temperature": 0,
}


async def answer(harness: Harness, body: dict[str, object] = CHAT) -> str:
    status, _, headers = await harness.post("/v1/chat/completions", body)
    assert status == 200
    return headers["Stackpin-Record"]


@pytest.mark.parametrize("store", KINDS)
async def test_a_deterministic_answer_replays_as_reproduced_and_the_replay_is_recorded(
    replica: FakeReplica, tmp_path: Path, store: str
) -> None:
    async with running_proxy([replica], tmp_path, store=store) as harness:
        record_id = await answer(harness)
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200
        assert result["outcome"] == "reproduced" and result["compared"] == "tokens"
        assert result["stack"] == replica.fingerprint
        replay = await harness.proxy.store.get_record(result["replay_record"], "local")
        assert replay is not None and replay.replay_of == record_id
        assert replay.entries[0].content["replay"]["outcome"] == "reproduced"
        assert (await harness.proxy.store.verify()).ok


async def test_a_nondeterministic_replica_diverges_at_the_perturbed_token(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        record_id = await answer(harness)
        replica.nondeterministic = True
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200
        assert result["outcome"] == "diverged" and result["reason"] == "logprob"
        assert 0 <= result["position"] < 8
        assert result["original_logprob"] != result["replayed_logprob"]


async def test_a_streamed_answer_with_a_drawn_seed_replays_with_that_seed(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        body = {**CHAT, "temperature": 0.8, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json=body) as r,
        ):
            record_id = r.headers["Stackpin-Record"]
            await r.read()
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert status == 200 and result["outcome"] == "reproduced"
        assert isinstance(replica.requests[-1]["seed"], int), "the drawn seed is sent"
        assert replica.requests[-1]["stream"] is True, "a stream replays as a stream, event by event"
        replay = await harness.proxy.store.get_record(result["replay_record"], "local")
        assert replay is not None and [e.part for e in replay.entries] == ["opened", "closed"]
        assert replay.replay_of == record_id
        assert replay.entries[-1].content["replay"]["outcome"] == "reproduced"


async def test_replay_on_another_stack_and_on_a_stack_with_no_live_replica(
    replica: FakeReplica, tmp_path: Path
) -> None:
    other = FakeReplica(stack={**replica.stack, "kernel_mode": "default"})
    await other.start()
    try:
        async with running_proxy([replica, other], tmp_path) as harness:
            record_id = await answer(harness, {**CHAT, "stackpin": {"kernel_mode": "batch_invariant"}})
            status, result, _ = await harness.post(
                f"/v1/records/{record_id}/replay", {"on": {"kernel_mode": "default"}}
            )
            assert status == 200 and result["stack"] == other.fingerprint
            harness.proxy.registry.unreachable("replica-0")
            status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
            assert status == 503
            assert [s["fingerprint"] for s in result["error"]["live_stacks"]] == [other.fingerprint]
    finally:
        await other.stop()


async def test_the_cli_exits_0_when_reproduced_1_when_diverged_2_on_error(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        record_id = await answer(harness)

        def replay(*extra: str) -> int:
            return stackpin(["replay", record_id, "--url", harness.url, *extra])

        assert await asyncio.to_thread(replay) == 0
        assert "reproduced" in capsys.readouterr().out
        replica.nondeterministic = True
        assert await asyncio.to_thread(replay) == 1
        printed = capsys.readouterr().out
        assert "diverged" in printed and "first divergence at token" in printed
        replica.nondeterministic = False
        assert await asyncio.to_thread(replay, "--json") == 0
        assert json.loads(capsys.readouterr().out)["outcome"] == "reproduced"
        harness.proxy.registry.unreachable("replica-0")
        assert await asyncio.to_thread(replay) == 2
        printed = capsys.readouterr().err
        assert "none of their replicas is in rotation" in printed and "no stack is live" in printed
        assert await asyncio.to_thread(lambda: stackpin(["replay", "rec_unknown", "--url", harness.url])) == 2


def sync_answer(harness: Harness, stream: bool, **request: Any) -> str:
    """The official SDK's synchronous client, as most applications use it; returns the record id."""
    client = openai.OpenAI(base_url=harness.v1, api_key="unused-on-loopback", max_retries=0)
    try:
        raw = client.chat.completions.with_raw_response.create(stream=stream, **request)
        if stream:
            for _ in raw.parse():
                pass
        else:
            raw.parse()
        return raw.headers["Stackpin-Record"]
    finally:
        client.close()


async def async_answer(harness: Harness, stream: bool, **request: Any) -> str:
    client = openai.AsyncOpenAI(base_url=harness.v1, api_key="unused-on-loopback", max_retries=0)
    try:
        raw = await client.chat.completions.with_raw_response.create(stream=stream, **request)
        parsed = raw.parse()
        if stream:
            async for _ in parsed:
                pass
        return raw.headers["Stackpin-Record"]
    finally:
        await client.close()


CHANGES = [
    # (client, streamed, what the upstream changes, the request, what the replay must name)
    (
        "sync",
        False,
        "tool_arguments",
        {"tools": TOOLS},
        "choice 0, field message.tool_calls[0].function.arguments, character",
    ),
    ("async", False, "later_choice", {"n": 2}, "choice 1, field message.content, character"),
    ("sync", True, "chunk_split", {}, "event 2, field choices[0].delta.content, character"),
    ("async", True, "chunk_text", {}, "choice 0, field message.content, character"),
    (
        "async",
        True,
        "tool_arguments",
        {"tools": TOOLS},
        "choice 0, field message.tool_calls[0].function.arguments",
    ),
    ("sync", True, "later_choice", {"n": 2}, "choice 1, field message.content"),
]


@pytest.mark.parametrize(("client", "stream", "change", "extra", "place"), CHANGES)
async def test_the_sdk_s_answer_replays_0_unchanged_and_1_naming_the_place_of_any_change(
    replica: FakeReplica,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    client: str,
    stream: bool,
    change: str,
    extra: dict[str, Any],
    place: str,
) -> None:
    request = {
        "model": "fake-model",
        "messages": CHAT["messages"],
        "max_tokens": 6,
        "temperature": 0,
        **extra,
    }
    async with running_proxy([replica], tmp_path) as harness:
        if client == "sync":
            record_id = await asyncio.to_thread(sync_answer, harness, stream, **request)
        else:
            record_id = await async_answer(harness, stream, **request)

        def replay() -> int:
            return stackpin(["replay", record_id, "--url", harness.url])

        assert await asyncio.to_thread(replay) == 0, capsys.readouterr()
        assert "reproduced" in capsys.readouterr().out
        replica.alter = change
        assert await asyncio.to_thread(replay) == 1
        printed = capsys.readouterr().out
        assert "diverged" in printed and f"first divergence at {place}" in printed, printed


async def test_a_streamed_tool_calls_record_rebuilds_the_exact_event_stream_the_client_read(
    replica: FakeReplica, tmp_path: Path
) -> None:
    body = {**CHAT, "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}}
    async with running_proxy([replica], tmp_path) as harness:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{harness.v1}/chat/completions", json=body) as response,
        ):
            record_id = response.headers["Stackpin-Record"]
            read = await response.read()
        record = await harness.proxy.store.get_record(record_id, "local")
        assert record is not None
        closed = record.entries[-1].content
        receipt = (
            f": Stackpin-Receipt {record.entries[-1].receipt}\n\n"  # the closed entry's, which it cannot hold
        )
        assert ("".join(closed["events"]) + receipt + closed["terminal"]).encode() == read
        assert closed["terminal"] == "data: [DONE]\n\n" and closed["chunks"] == len(closed["events"])
        call = closed["answer"]["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "weather"
        assert json.loads(call["function"]["arguments"])["units"] == "metric"
        assert closed["answer"]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_replica_answering_garbage_fails_a_replay_as_it_fails_a_request(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        record_id = await answer(harness)
        replica.failure = "garbage"
        direct, _, _ = await harness.post("/v1/chat/completions", CHAT)
        status, result, _ = await harness.post(f"/v1/records/{record_id}/replay", {})
        assert direct == status == 502 and "not an OpenAI response" in result["error"]["message"]
        async with aiohttp.ClientSession() as session, session.get(f"{harness.url}/metrics") as response:
            assert 'stackpin_replays_total{outcome="error"} 1.0' in await response.text()


async def test_a_stream_recorded_before_records_kept_events_still_replays(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        live = harness.proxy.registry.get("replica-0")
        assert live is not None
        body = {**CHAT, "model": "fake-model", "stream": True}
        ids, logprobs, text, _ = replica.completion(body)
        served = Served("rec_" + "0" * 32, "local", "/v1/chat/completions", pin_of(live), None, None, live.snapshot(),
                        body, datetime.now(UTC))  # fmt: skip
        await harness.proxy.store.append(opened_entry(served, datetime.now(UTC)))
        legacy = closed_entry(served, datetime.now(UTC), status="complete", events=[], terminal=None, answer=None,
                              replica_answer=None, upstream_fingerprint=None, error=None)  # fmt: skip
        tokens = {"text": text, "finish_reason": "length", "token_ids": ids, "token_logprobs": logprobs,
                  "prompt_token_ids": [1, 2, 3], "batch": None, "seed": None}  # fmt: skip
        content = {
            k: v
            for k, v in load_canonical(legacy.content_json).items()
            if k not in ("events", "terminal", "answer")
        }
        kept = (
            "record_id",
            "part",
            "tenant",
            "created_at",
            "replica",
            "model",
            "fingerprint",
            "stack_declared",
            "status",
        )
        old = seal(**{k: getattr(legacy, k) for k in kept}, content={**content, "tokens": tokens})
        await harness.proxy.store.append(old)
        status, result, _ = await harness.post(f"/v1/records/{served.record_id}/replay", {})
        assert status == 200 and result["outcome"] == "reproduced", result
        replica.nondeterministic = True
        status, result, _ = await harness.post(f"/v1/records/{served.record_id}/replay", {})
        assert result["outcome"] == "diverged" and result["field"] == "tokens"


def pin_of(replica: Any) -> Pin:
    return Pin(stack=replica.fingerprint)
