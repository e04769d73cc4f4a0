"""Fleet state shared through Redis: every proxy routes from the same leases, quarantines and outstanding counts,
and a proxy that loses Redis serves its last view for a bounded time, says so, and never serves a stack that does
not match a pin because of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.fleet.documents import Quarantine
from tests.support.audit_databases import audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import Fleet, RedisRelay, running_fleet

pytestmark = pytest.mark.redis

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 3,
    "temperature": 0,
}


async def flags_of(fleet: Fleet) -> list[str]:
    store = fleet.proxies[0].proxy.store
    entries = []
    for summary in await store.list_records(limit=1000):
        record = await store.get_record(summary.id, None)
        assert record is not None
        entries += [summary.id for _ in record.flags]
    return entries


async def test_a_leased_replica_serves_through_every_proxy(replica: FakeReplica, tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}) as fleet:
            for proxy in fleet.proxies:
                status, body, headers = await proxy.post("/v1/chat/completions", CHAT)
                assert status == 200, body
                assert headers["Stackpin-Stack"] == replica.fingerprint
                _, stacks = await proxy.get("/v1/stacks")
                assert [s["replicas"] for s in stacks["stacks"]] == [["r1"]]
                assert stacks["replicas"][0]["leased"] is True
            assert len(replica.requests) == 2


async def test_a_replica_whose_lease_expires_leaves_rotation_for_every_proxy(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}) as fleet:
            fleet.beats["r1"].lease_s = 0.2
            await fleet.beat()
            await replica.stop()
            await fleet.beat()  # unreachable: not renewed
            lease_key = fleet.state.keys.lease("r1")
            for _ in range(100):
                if not await fleet.state.client.exists(lease_key):
                    break
                await asyncio.sleep(0.05)
            await fleet.sync_all()
            for proxy in fleet.proxies:
                status, body, _ = await proxy.post("/v1/chat/completions", CHAT)
                assert status == 503, body
                assert body["error"]["code"] == "no_live_replica"


async def test_a_stack_change_found_by_the_sidecar_quarantines_everywhere_and_marks_each_record_once(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}) as fleet:
            served = []
            for proxy in fleet.proxies:
                _, _, headers = await proxy.post("/v1/chat/completions", CHAT)
                served.append(headers["Stackpin-Record"])
            fleet.clock.advance(1)
            replica.stack = {**replica.stack, "quantisation": "bf16"}
            await fleet.beat()
            await fleet.sync_all()
            for proxy in fleet.proxies:
                _, stacks = await proxy.get("/v1/stacks")
                assert stacks["replicas"][0]["quarantined"] == "stack_changed"
                status, body, _ = await proxy.post("/v1/chat/completions", CHAT)
                assert status == 503 and body["error"]["code"] == "no_live_replica"
            assert sorted(await flags_of(fleet)) == sorted(served), "every record marked, and only once"
            # The backend going back, and every proxy checking again, lifts nothing.
            replica.stack = {**replica.stack, "quantisation": "fp32"}
            await fleet.beat()
            await fleet.sync_all()
            for proxy in fleet.proxies:
                await proxy.proxy.health.check_all()
                assert proxy.proxy.registry.live() == []


async def test_a_quarantine_found_by_one_proxy_holds_for_the_others(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"a": replica, "b": twin}) as fleet:
            first, second = fleet.proxies
            _, _, headers = await second.post(
                "/v1/chat/completions", CHAT
            )  # served by "a": ties go to the name
            replica.failure = "wrong_fingerprint"
            status, _, _ = await first.post("/v1/chat/completions", CHAT)
            assert status == 200, "retried on the twin of the identical fingerprint"
            await fleet.sync_all()
            note = Quarantine.model_validate_json(
                await fleet.state.client.get(fleet.state.keys.quarantine("a"))
            )
            assert note.reason == "fingerprint_mismatch" and note.by == fleet.sync(0).proxy_id
            assert second.proxy.registry.get("a").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]
            assert await flags_of(fleet) == [headers["Stackpin-Record"]]
            replica.failure = None
            status, _, reply = await second.post("/v1/chat/completions", CHAT)
            assert status == 200 and reply["Stackpin-Stack"] == twin.fingerprint
            assert len(replica.requests) == 2, "nothing more reached the quarantined replica"


async def test_outstanding_requests_are_shared_for_routing(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"a": replica, "b": twin}) as fleet:
            first, second = fleet.proxies
            # Two requests in flight to "a" through the first proxy, as the dispatcher counts them.
            first.proxy.registry.acquire("a")
            first.proxy.registry.acquire("a")
            await fleet.sync(0).link.drain()
            await fleet.sync_all()
            assert second.proxy.registry.get("a").outstanding == 2  # type: ignore[union-attr]
            _, _, headers = await second.post("/v1/chat/completions", CHAT)
            assert headers["Stackpin-Stack"] == twin.fingerprint and len(twin.requests) == 1
            first.proxy.registry.release("a")
            first.proxy.registry.release("a")
            await fleet.sync(0).link.drain()
            await fleet.sync_all()
            assert second.proxy.registry.get("a").outstanding == 0  # type: ignore[union-attr]


async def test_the_counts_of_a_proxy_that_stopped_publishing_expire(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"a": replica, "b": twin}) as fleet:
            first, second = fleet.proxies
            first.proxy.registry.acquire("a")
            await fleet.sync(0).link.drain()
            await fleet.sync_all()
            assert second.proxy.registry.get("a").outstanding == 1  # type: ignore[union-attr]
            # The first proxy dies with a request in flight: it publishes nothing more, and its counts expire
            # five sync intervals after its last publication.
            fleet.clock.advance(5 * first.settings.fleet.sync_interval_s + 1)
            await fleet.beat()
            await fleet.sync(1).round()
            assert second.proxy.registry.get("a").outstanding == 0  # type: ignore[union-attr]
            first.proxy.registry.release("a")


async def test_without_redis_a_proxy_serves_its_last_view_for_the_bound_then_refuses(
    replica: FakeReplica, tmp_path: Path
) -> None:
    relay = RedisRelay()
    await relay.start()
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}, proxies=1, redis_url=relay.url) as fleet:
            (proxy,) = fleet.proxies
            await relay.cut()
            assert not await fleet.sync(0).round()
            status, ready = await proxy.get("/readyz")
            assert status == 200 and ready["fleet"]["state"] == "stale" and ready["fleet"]["error"]
            assert (await proxy.post("/v1/chat/completions", CHAT))[0] == 200, "the last view still serves"
            assert "stackpin_fleet_state_stale 1.0" in await metrics_text(proxy.url)
            fleet.clock.advance(31)  # past fleet.max_stale_s
            assert not await fleet.sync(0).round()
            status, ready = await proxy.get("/readyz")
            assert status == 503 and "max_stale_s" in " ".join(ready["problems"])
            status, body, _ = await proxy.post("/v1/chat/completions", CHAT)
            assert status == 503 and body["error"]["code"] == "no_live_replica"
            await relay.start()
            await fleet.beat()
            assert await fleet.sync(0).round()
            assert (await proxy.get("/readyz"))[1]["fleet"]["state"] == "fresh"
            assert "stackpin_fleet_state_stale 0.0" in await metrics_text(proxy.url)
            assert (await proxy.post("/v1/chat/completions", CHAT))[0] == 200


async def test_a_stale_view_never_serves_a_stack_the_pin_does_not_match(
    replica: FakeReplica, tmp_path: Path
) -> None:
    relay = RedisRelay()
    await relay.start()
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}, proxies=1, redis_url=relay.url) as fleet:
            (proxy,) = fleet.proxies
            await relay.cut()
            assert not await fleet.sync(0).round()
            # The backend changes under the proxy while its sidecar cannot report it.
            replica.stack = {**replica.stack, "quantisation": "bf16"}
            status, body, _ = await proxy.post(
                "/v1/chat/completions", CHAT, headers={"Stackpin-Pin": "quantisation=fp32"}
            )
            assert status == 502, body
            assert proxy.proxy.registry.get("r1").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]
            assert await flags_of(fleet) == [], "nothing was served, so nothing to mark"
            await relay.start()
            assert await fleet.sync(0).round()
            assert await fleet.state.client.exists(fleet.state.keys.quarantine("r1")), (
                "shared once Redis is back"
            )


async def metrics_text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        return await response.text()
