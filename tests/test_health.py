"""The health monitor: a backend enters rotation when it proves its stack at `GET /v1/stack`, leaves it while
unreachable, and is quarantined when its stack changes or it lies about it; then every record it produced since its
last good check is flagged (invariant 3), once across a fleet. A declared upstream is never asked.

Replicas are fake backends on loopback, the store is a real one, and in fleet mode the board is a real Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.audit import AuditStore
from proxy.errors import StackMismatch
from proxy.fleet.documents import FleetKeys
from proxy.fleet.link import FleetLink
from proxy.fleet.state import FleetState, connect
from proxy.metrics import ProxyMetrics
from proxy.replicas.health import HealthMonitor, QuarantineBoard
from proxy.replicas.kinds import STACKPIN, UPSTREAM
from proxy.replicas.registry import Registry, Replica
from proxy.stack import Stack
from tests.support.audit_databases import KINDS, T0, audit_database, entry
from tests.support.fake_replica import FakeReplica, tiny_stack
from tests.support.fleet import REDIS_URL, Clock, redis_prefix


@dataclass
class Monitored:
    health: HealthMonitor
    registry: Registry
    store: AuditStore
    clock: Clock
    metrics: ProxyMetrics

    def replica(self, name: str = "backend") -> Replica:
        replica = self.registry.get(name)
        assert replica is not None
        return replica

    async def flags(self, record_id: str) -> list[str]:
        record = await self.store.get_record(record_id, None)
        assert record is not None
        return [flag.status for flag in record.flags]


@asynccontextmanager
async def store_of(kind: str, folder: Path) -> AsyncIterator[AuditStore]:
    async with audit_database(kind, folder) as database:
        await database.migrate()
        store = await database.open()
        try:
            yield store
        finally:
            await store.close()


@asynccontextmanager
async def monitoring(
    store: AuditStore, *replicas: Replica, board: QuarantineBoard | None = None
) -> AsyncIterator[Monitored]:
    clock, metrics, registry = Clock(T0), ProxyMetrics(CollectorRegistry()), Registry.of(replicas)
    async with aiohttp.ClientSession() as session:
        health = HealthMonitor(registry, store, session, metrics, timeout_s=2.0, clock=clock, board=board)
        yield Monitored(health, registry, store, clock, metrics)


def backend(fake: FakeReplica, name: str = "backend") -> Replica:
    return Replica(name=name, url=fake.url, kind=STACKPIN)


async def test_a_backend_enters_rotation_when_it_first_proves_its_stack(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with store_of("sqlite", tmp_path) as store, monitoring(store, backend(replica)) as watched:
        assert watched.registry.live() == []
        await watched.health.check_all()
        (live,) = watched.registry.live()
        assert live.fingerprint == replica.fingerprint and live.last_good_check == T0
        assert live.stack == Stack.model_validate(tiny_stack())


async def test_an_unreachable_backend_leaves_rotation_and_returns_when_it_answers_again(
    tmp_path: Path,
) -> None:
    fake = FakeReplica()
    await fake.start()
    port = int(fake.url.rsplit(":", 1)[1])
    try:
        async with store_of("sqlite", tmp_path) as store, monitoring(store, backend(fake)) as watched:
            await watched.health.check_all()
            await fake.stop()
            await watched.health.check_all()
            assert watched.registry.live() == [] and watched.replica().quarantined is None
            await fake.start(port)
            await watched.health.check_all()
            assert [r.name for r in watched.registry.live()] == ["backend"]
    finally:
        await fake.stop()


async def test_a_declared_upstream_is_never_asked_and_stays_in_rotation(tmp_path: Path) -> None:
    stack = Stack.model_validate(tiny_stack())
    # Nothing listens there: a check would find it unreachable.
    nowhere = Replica("upstream", "http://127.0.0.1:9", UPSTREAM, stack, stack.fingerprint, reachable=True)
    async with store_of("sqlite", tmp_path) as store, monitoring(store, nowhere) as watched:
        await watched.health.check_all()
        assert [r.name for r in watched.registry.live()] == ["upstream"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_changed_stack_quarantines_the_backend_and_flags_what_it_served_since_its_last_good_check(
    replica: FakeReplica, tmp_path: Path, kind: str
) -> None:
    async with store_of(kind, tmp_path) as store, monitoring(store, backend(replica)) as watched:
        await store.append(entry("rec_before", replica="backend", seconds=-60))
        await watched.health.check_all()  # its last good check: T0
        await store.append(entry("rec_after", replica="backend", seconds=30))
        await store.append(entry("rec_elsewhere", replica="another", seconds=30))
        replica.stack = tiny_stack(quantisation="bf16")
        watched.clock.advance(60)
        await watched.health.check_all()
        assert watched.replica().quarantined == "stack_changed" and watched.registry.live() == []
        assert await watched.flags("rec_after") == ["stack_changed"]
        assert await watched.flags("rec_before") == [], "vouched for by the good check after it"
        assert await watched.flags("rec_elsewhere") == [], "served by another replica"
        replica.stack = tiny_stack()
        await watched.health.check_all()
        assert watched.registry.live() == [], (
            "a quarantine outlives the stack coming back: an operator lifts it"
        )


async def test_a_backend_that_lies_about_its_fingerprint_is_quarantined(tmp_path: Path) -> None:
    liar = FakeReplica()

    async def lying(_request: web.Request) -> web.Response:
        return web.json_response({"stack": liar.stack, "fingerprint": "0" * 64})

    liar._stack = lying  # type: ignore[method-assign]  # only GET /v1/stack lies
    await liar.start()
    try:
        async with store_of("sqlite", tmp_path) as store, monitoring(store, backend(liar)) as watched:
            await watched.health.check_all()
            assert watched.replica().quarantined == "fingerprint_mismatch"
            assert watched.registry.live() == []
    finally:
        await liar.stop()


async def test_an_answer_under_another_fingerprint_quarantines_the_replica_it_came_from(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with store_of("sqlite", tmp_path) as store, monitoring(store, backend(replica)) as watched:
        await watched.health.check_all()
        await store.append(entry("rec_served", replica="backend", seconds=1))
        dispatched_to = watched.replica().snapshot()
        await watched.health.on_mismatch(StackMismatch(dispatched_to, "f" * 64))
        assert watched.replica().quarantined == "fingerprint_mismatch"
        assert await watched.flags("rec_served") == ["fingerprint_mismatch"]
        sample = watched.metrics.registry.get_sample_value(
            "stackpin_records_marked_total", {"reason": "fingerprint_mismatch"}
        )
        assert sample == 1.0


async def test_a_lifted_quarantine_returns_the_backend_and_leaves_its_records_marked(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with store_of("sqlite", tmp_path) as store, monitoring(store, backend(replica)) as watched:
        await watched.health.check_all()
        await store.append(entry("rec_served", replica="backend", seconds=1))
        await watched.health.quarantine(watched.replica(), "stack_changed", claimed="f" * 64)
        watched.registry.lift("backend", watched.clock())
        await watched.health.check_all()
        assert [r.name for r in watched.registry.live()] == ["backend"]
        assert await watched.flags("rec_served") == ["stack_changed"], "a lift does not unmark (invariant 3)"


async def test_in_a_fleet_the_quarantine_is_shared_and_its_records_are_flagged_once(
    replica: FakeReplica, tmp_path: Path
) -> None:
    async with redis_prefix() as prefix, store_of("sqlite", tmp_path) as store:
        state = FleetState(connect(REDIS_URL, timeout_s=2.0), FleetKeys(prefix))
        try:
            first = FleetLink(state, proxy_id="proxy-first", clock=Clock(T0))
            second = FleetLink(state, proxy_id="proxy-second", clock=Clock(T0))
            async with (
                monitoring(store, backend(replica), board=first) as one,
                monitoring(store, backend(replica), board=second) as other,
            ):
                await one.health.check_all()
                await other.health.check_all()
                await store.append(entry("rec_served", replica="backend", seconds=1))
                for watched in (one, other):
                    await watched.health.quarantine(watched.replica(), "stack_changed", claimed="f" * 64)
                    assert watched.replica().quarantined == "stack_changed"
                assert await one.flags("rec_served") == ["stack_changed"], "flagged by one proxy only"
                note = (await state.read("proxy-first", T0.timestamp())).quarantines["backend"]
                assert note.by == "proxy-first" and note.last_good_check == T0
        finally:
            await state.close()
