"""Replaying a slice of traffic: every original the filter selects replayed, on its own stack or another, bounded
in concurrency and rate, and the agreement counted overall, per route and per prompt version, with the first
divergences; replays, unfinished streams and records the caller may not replay left out; a replay that fails
counted, not fatal."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.audit import AuditRecord, RecordFilter
from proxy.evidence.slice_replay import (
    NotReplayable,
    Outcome,
    Pacer,
    ReplayFailed,
    SliceReport,
    replay_slice,
)
from proxy.pins import Pin
from tests.support.fake_replica import FakeReplica, tiny_stack
from tests.support.proxy_harness import Harness, running_proxy

ROUTES = {"support-bot": {"model": "fake-model", "kernel_mode": "batch_invariant", "prompt": "support@3"}}


def chat(content: str, model: str = "fake-model", **more: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 5, **more}


@pytest.fixture
async def traffic(tmp_path: Path) -> AsyncIterator[tuple[Harness, FakeReplica, FakeReplica, datetime]]:
    invariant, default = FakeReplica(), FakeReplica(stack=tiny_stack(kernel_mode="default"))
    for fake in (invariant, default):
        await fake.start()
    try:
        async with running_proxy(
            [invariant, default], tmp_path, routes=ROUTES, prompts={"support@3": "You are a careful agent."}
        ) as harness:
            began = datetime.now(UTC) - timedelta(seconds=1)
            pin = {"Stackpin-Pin": "kernel_mode=batch_invariant"}
            for k in range(6):
                assert (await harness.post("/v1/chat/completions", chat(f"question {k}"), headers=pin))[
                    0
                ] == 200
            for k in range(3):
                assert (await harness.post("/v1/chat/completions", chat(f"help {k}", "support-bot")))[
                    0
                ] == 200
            invariant.failure = "drop_stream"
            async with aiohttp.ClientSession() as session:
                body = chat("a stream that breaks", stream=True)
                async with session.post(f"{harness.v1}/chat/completions", json=body, headers=pin) as response:
                    await response.read()
            invariant.failure = None
            yield harness, invariant, default, began
    finally:
        for fake in (invariant, default):
            await fake.stop()


def replaying(harness: Harness, on: Pin | None = None) -> Any:
    async def replay(record: AuditRecord) -> dict[str, Any]:
        replay_id, comparison, stack = await harness.proxy.replay(record, record.tenant, on)
        return {"record": record.id, "replay_record": replay_id, "stack": stack, **comparison.as_json()}

    return replay


async def test_a_slice_replayed_on_its_own_stacks_is_identical_per_route_and_prompt_version(
    traffic: Any,
) -> None:
    harness, _, _, began = traffic
    seen: list[Outcome] = []
    report = await replay_slice(
        harness.proxy.store,
        RecordFilter(since=began),
        replaying(harness),
        concurrency=3,
        on_outcome=seen.append,
    )
    summary = report.as_json()
    assert summary["counts"]["identical"] == 9 and report.replayed == 9 and len(seen) == 9
    assert summary["skipped"] == {"interrupted: no complete answer": 1}
    assert (
        summary["by_route"]["support-bot"]["replayed"] == 3 and summary["by_route"]["(none)"]["replayed"] == 6
    )
    assert summary["by_prompt"]["support@3"]["identical"] == 1.0
    assert summary["at_least"]["identical"] == 1.0 and not summary["divergences"]
    replays = await harness.proxy.store.list_records(replays_only=True)
    assert {r.replay_of for r in replays} == {o.record for o in seen}, "each replay is linked to its original"

    again = await replay_slice(harness.proxy.store, RecordFilter(since=began), replaying(harness))
    assert again.replayed == 9, "the replays of the first run are not replayed in turn"


async def test_on_another_stack_each_divergence_says_where_and_is_counted_by_level(traffic: Any) -> None:
    harness, _, default, began = traffic
    default.diverge_from = 2
    report = await replay_slice(
        harness.proxy.store,
        RecordFilter(since=began, model="fake-model"),
        replaying(harness, Pin(kernel_mode="default")),
        limit=4,
    )
    assert report.replayed == 4 and report.counts["diverged"] == 4
    first = report.examples[0]
    assert (first.position, first.reason, first.where) == (2, "token", "token 2 of choice 0")
    assert first.replay_record is not None and report.positions == {2: 4}

    default.diverge_from, default.nondeterministic = None, True
    report = await replay_slice(
        harness.proxy.store,
        RecordFilter(since=began),
        replaying(harness, Pin(kernel_mode="default")),
        limit=3,
    )
    assert report.counts["same_tokens"] == 3, "only logprob bits differ: the same tokens"
    assert (
        report.as_json()["at_least"]["same_tokens"] == 1.0
        and report.as_json()["at_least"]["identical"] == 0.0
    )


async def test_a_failed_replay_counts_against_the_slice_and_the_rest_goes_on(traffic: Any) -> None:
    harness, _, _, began = traffic
    calls = 0

    async def flaky(record: AuditRecord) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:
            raise ReplayFailed("HTTP 503: the replica is busy")
        return await replaying(harness)(record)

    report = await replay_slice(harness.proxy.store, RecordFilter(since=began), flaky, concurrency=1)
    assert report.counts["failed"] == 3 and report.counts["identical"] == 6
    assert report.as_json()["at_least"]["identical"] == 6 / 9
    assert report.examples[0].error == "HTTP 503: the replica is busy"

    async def theirs(record: AuditRecord) -> dict[str, Any]:
        raise NotReplayable("not yours to replay")

    report = await replay_slice(harness.proxy.store, RecordFilter(since=began), theirs)
    assert report.replayed == 0 and report.skipped["not yours to replay"] == 9

    async def broken(record: AuditRecord) -> dict[str, Any]:
        raise RuntimeError("the proxy went away")

    with pytest.raises(RuntimeError, match="went away"):
        await replay_slice(harness.proxy.store, RecordFilter(since=began), broken, concurrency=3)


async def test_no_more_than_c_replays_are_in_flight(traffic: Any) -> None:
    harness, _, _, began = traffic
    in_flight = most = 0

    async def slow(record: AuditRecord) -> dict[str, Any]:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return {"outcome": "reproduced"}

    report = await replay_slice(harness.proxy.store, RecordFilter(since=began), slow, concurrency=2)
    assert most == 2 and report.counts["identical"] == 9, (
        "a proxy that gives no agreement: its outcome counts"
    )


async def test_the_pacer_starts_at_most_rate_a_second() -> None:
    pacer = Pacer(rate=100)
    started = time.monotonic()
    for _ in range(6):
        await pacer.wait()
    assert time.monotonic() - started >= 0.05, "six starts at 100 a second take at least 50 ms"
    unbounded = Pacer(rate=None)
    await unbounded.wait()


def test_the_report_keeps_a_few_examples_however_many_diverge() -> None:
    report = SliceReport()
    for k in range(100):
        report.add(Outcome(f"rec_{k}", None, None, "diverged", position=k % 3))
    assert len(report.examples) == 20 and report.replayed == 100 and report.positions == {0: 34, 1: 33, 2: 33}
