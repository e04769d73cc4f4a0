"""Serving a request: dispatched to a replica that matches its pin, recorded, then answered (invariant 1).

A non-streamed answer reaches the client only once its record holds the very body the client gets. A stream's
record is opened before its first byte and closed before the event that ends it. What a record says served the
request is the replica as it was at dispatch: a quarantine lifted and a new stack proved mid-stream change nothing
in it. Tokens are counted under the stack that served them. And serving is fair: fast, long streams through the
proxy do not hold up another client's requests.

The replicas are fake backends on loopback, the store a real SQLite file. For fairness the replica is a process of
its own that streams as fast as a socket takes it (the benchmarks' trivial replica), so that the proxy's relay
always finds events already buffered; another client meanwhile sends a request every 20 ms and measures each from
when it was due. The figures, measured apart from the test suite (`python -m bench.fairness`), are in
bench/results/fairness.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import sys
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest

from proxy.audit import AuditRecord
from tests.support.fake_replica import FakeReplica, fingerprint_of, tiny_stack
from tests.support.proxy_harness import Harness, running_proxy

STREAM = {"model": "trivial", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def fast_upstream() -> AsyncIterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "bench.trivial_replica", str(port), "--stream-events", "2500"]
    process = await asyncio.create_subprocess_exec(*command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                with contextlib.suppress(aiohttp.ClientConnectionError):
                    async with session.get(f"{url}/v1/stack") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.1)
        yield url
    finally:
        process.terminate()
        await process.wait()


async def latencies_ms(harness: Harness, until: Callable[[], bool]) -> list[float]:
    """A /healthz every 20 ms until `until()`, each timed from when it was due, as a client would see it."""
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, due: float) -> float:
        async with session.get(f"{harness.url}/healthz") as response:
            await response.read()
        return (loop.time() - due) * 1000

    async with aiohttp.ClientSession() as session:
        started, sent = loop.time(), []
        while not until():
            due = started + len(sent) * 0.02
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent.append(asyncio.create_task(one(session, due)))
        return list(await asyncio.gather(*sent))


async def drain(harness: Harness) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{harness.v1}/chat/completions", json=STREAM) as response,
    ):
        return sum([len(chunk) async for chunk in response.content.iter_any()])


async def test_long_fast_streams_do_not_starve_another_client(fast_upstream: str, tmp_path: Path) -> None:
    replicas = [{"name": "fast", "url": fast_upstream}]
    async with running_proxy([], tmp_path, replicas=replicas) as harness:
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + 0.5
        unloaded = statistics.median(await latencies_ms(harness, lambda: loop.time() > quiet_until))
        streams = [asyncio.create_task(drain(harness)) for _ in range(8)]
        loaded = await latencies_ms(harness, lambda: all(s.done() for s in streams))
        sizes = await asyncio.gather(*streams)
    assert all(size > 2500 * 150 for size in sizes), "every stream was relayed whole"
    # Measured here: about 10 ms with the relay yielding between events, about 700 ms without.
    assert statistics.median(loaded) < unloaded + 250, (unloaded, statistics.median(loaded))


async def record_of(harness: Harness, record_id: str) -> AuditRecord:
    record = await harness.proxy.store.get_record(record_id, "local")
    assert record is not None
    return record


async def test_an_answer_is_sent_once_its_record_holds_the_body_the_client_gets(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        status, body, headers = await harness.post("/v1/chat/completions", CHAT)
        assert status == 200 and headers["Stackpin-Stack"] == replica.fingerprint
        record = await record_of(harness, headers["Stackpin-Record"])
        (answer,) = record.entries
        assert answer.part == "answer" and answer.content["response"] == body
        assert body["system_fingerprint"] == replica.fingerprint == record.fingerprint
        assert answer.content["request"] == {**CHAT, "model": "fake-model"}, (
            "exactly what the replica was sent"
        )


async def test_a_tag_is_kept_in_the_record_and_never_reaches_the_replica(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        tag = "study/st-1a2b/a/c8+b4/17"
        status, _, headers = await harness.post("/v1/chat/completions", CHAT, headers={"Stackpin-Tag": tag})
        assert status == 200
        record = await record_of(harness, headers["Stackpin-Record"])
        assert record.entries[0].content["tag"] == tag
        assert "Stackpin-Tag" not in replica.headers_seen[-1] and "tag" not in replica.requests[-1]
        status, _, headers = await harness.post("/v1/chat/completions", CHAT)
        assert "tag" not in (await record_of(harness, headers["Stackpin-Record"])).entries[0].content

        for bad in ("", "-leading", "has space", "x" * 201, "semi;colon"):
            status, body, _ = await harness.post("/v1/chat/completions", CHAT, headers={"Stackpin-Tag": bad})
            assert status == 400 and body["error"]["param"] == "Stackpin-Tag", bad
            assert "Stackpin-Tag must be" in body["error"]["message"]


async def test_a_streams_record_is_opened_before_its_first_byte_and_closed_before_its_end(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness, aiohttp.ClientSession() as session:
        async with session.post(f"{harness.v1}/chat/completions", json={**CHAT, "stream": True}) as response:
            record_id = response.headers["Stackpin-Record"]
            # Already committed when the headers arrive; the stream may since have ended, and its record closed.
            assert (await record_of(harness, record_id)).entries[0].part == "opened"
            received = []
            async for line in response.content:
                if line.strip() == b"data: [DONE]":
                    record = await record_of(harness, record_id)
                    assert [e.part for e in record.entries] == ["opened", "closed"], "closed before the end"
                    assert record.status == "complete"
                received.append(line)
        assert received[-2:] == [b"data: [DONE]\n", b"\n"]


async def test_the_record_names_the_replica_as_it_was_at_dispatch_whatever_happens_to_it_mid_stream(
    tmp_path: Path,
) -> None:
    slow = FakeReplica(chunk_delay_s=0.05)
    await slow.start()
    served_by = slow.fingerprint
    try:
        async with running_proxy([slow], tmp_path) as harness, aiohttp.ClientSession() as session:
            body = {**CHAT, "max_tokens": 12, "stream": True}
            async with session.post(f"{harness.v1}/chat/completions", json=body) as response:
                first = await response.content.readline()
                assert first.startswith(b"data: ")
                # Mid-stream the replica is quarantined, lifted, and proves another stack: it is a new replica.
                live = harness.proxy.registry.get("replica-0")
                assert live is not None
                await harness.proxy.health.quarantine(live, "stack_changed", claimed="f" * 64)
                harness.proxy.registry.lift("replica-0", datetime.now(UTC))
                slow.stack = tiny_stack(quantisation="bf16")
                await harness.proxy.health.check_all()
                assert live.fingerprint == fingerprint_of(slow.stack) != served_by
                await response.read()
                record_id = response.headers["Stackpin-Record"]
            record = await record_of(harness, record_id)
            opened, closed = record.entries
            assert record.status == "complete"
            for entry in (opened, closed):
                assert entry.fingerprint == served_by and entry.replica == "replica-0"
            assert record.fingerprint == served_by and record.stack is not None
            assert record.stack["quantisation"] == "fp32", "the stack that served it, not the later one"
            assert [flag.status for flag in record.flags] == ["stack_changed"]
    finally:
        await slow.stop()


async def test_tokens_are_counted_under_the_stack_that_served_them(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with running_proxy([replica], tmp_path) as harness:
        _, body, _ = await harness.post("/v1/chat/completions", CHAT)
        async with aiohttp.ClientSession() as session, session.get(f"{harness.url}/metrics") as response:
            exported = await response.text()
        completion = body["usage"]["completion_tokens"]
        labels = f'direction="completion",fingerprint="{replica.fingerprint}",model="fake-model"'
        assert f"stackpin_tokens_total{{{labels}}} {float(completion)}" in exported, exported
