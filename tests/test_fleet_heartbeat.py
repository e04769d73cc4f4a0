"""The heartbeat sidecar: it proves a backend's stack at GET /v1/stack and renews the replica's lease in Redis
with that stack; it quarantines a backend that changed its stack or lied about it, and renews nothing for one
that does not answer."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from proxy.commands.cli import main as stackpin
from proxy.fleet.documents import FleetKeys, Lease, Quarantine
from proxy.fleet.heartbeat import Beat, Heartbeat
from proxy.fleet.state import FleetState, connect
from proxy.replicas.kinds import kind_named
from tests.support.engine_documents import EngineDocuments, documents_of
from tests.support.fake_replica import FakeReplica, fingerprint_of
from tests.support.fleet import REDIS_URL, Clock, heartbeat_for, redis_prefix

pytestmark = pytest.mark.redis


async def test_a_beat_renews_the_lease_with_the_stack_the_backend_proved(replica: FakeReplica) -> None:
    clock = Clock()
    async with redis_prefix() as prefix:
        keys = FleetKeys(prefix)
        state = FleetState(connect(REDIS_URL, timeout_s=2), keys)
        async with heartbeat_for(state, replica, "r1", clock, lease_s=15) as heartbeat:
            assert await heartbeat.beat() is Beat.PROVED
            lease = Lease.model_validate_json(await state.client.get(keys.lease("r1")))
            assert lease.stack == replica.stack
            assert lease.fingerprint == lease.registered == replica.fingerprint
            assert lease.url == replica.url and lease.proved_at == clock.now
            assert 0 < await state.client.pttl(keys.lease("r1")) <= 15_000, "the lease must expire on its own"
            assert await state.client.smembers(keys.replicas) == {"r1"}
            assert await state.last_good("r1") == clock.now
        await state.close()


async def test_a_changed_stack_is_quarantined_for_the_fleet_with_its_last_good_check(
    replica: FakeReplica,
) -> None:
    clock = Clock()
    async with redis_prefix() as prefix:
        keys = FleetKeys(prefix)
        state = FleetState(connect(REDIS_URL, timeout_s=2), keys)
        async with heartbeat_for(state, replica, "r1", clock) as heartbeat:
            await heartbeat.beat()
            good_at = clock.now
            registered = replica.fingerprint
            clock.advance(5)
            replica.stack = {**replica.stack, "quantisation": "bf16"}
            assert await heartbeat.beat() is Beat.CHANGED
            note = Quarantine.model_validate_json(await state.client.get(keys.quarantine("r1")))
            assert (note.reason, note.registered, note.observed) == (
                "stack_changed",
                registered,
                replica.fingerprint,
            )
            assert note.last_good_check == good_at
            lease = Lease.model_validate_json(await state.client.get(keys.lease("r1")))
            assert lease.fingerprint != lease.registered, (
                "the lease shows what was proved, and that it changed"
            )
            # Changing back proves the registered stack again, and lifts nothing.
            replica.stack = {**replica.stack, "quantisation": "fp32"}
            assert await heartbeat.beat() is Beat.PROVED
            assert await state.client.exists(keys.quarantine("r1"))
        await state.close()


async def test_a_backend_that_lies_about_its_fingerprint_is_quarantined_and_not_leased(
    replica: FakeReplica,
) -> None:
    clock = Clock()

    async def lying(_request: web.Request) -> web.Response:
        return web.json_response({"stack": replica.stack, "fingerprint": "0" * 64})

    async with redis_prefix() as prefix:
        keys = FleetKeys(prefix)
        state = FleetState(connect(REDIS_URL, timeout_s=2), keys)
        liar = FakeReplica(stack=replica.stack)
        liar._stack = lying  # type: ignore[method-assign]  # its answers stay honest; only GET /v1/stack lies
        await liar.start()
        try:
            async with heartbeat_for(state, liar, "liar", clock) as heartbeat:
                assert await heartbeat.beat() is Beat.LIED
            note = json.loads(await state.client.get(keys.quarantine("liar")))
            assert note["reason"] == "fingerprint_mismatch" and note["observed"] == "0" * 64
            assert not await state.client.exists(keys.lease("liar"))
            assert fingerprint_of(replica.stack) != "0" * 64
        finally:
            await liar.stop()
            await state.close()


async def test_an_unreachable_backend_gets_no_renewal(replica: FakeReplica) -> None:
    clock = Clock()
    async with redis_prefix() as prefix:
        keys = FleetKeys(prefix)
        state = FleetState(connect(REDIS_URL, timeout_s=2), keys)
        async with heartbeat_for(state, replica, "r1", clock) as heartbeat:
            await replica.stop()
            assert await heartbeat.beat() is Beat.UNREACHABLE
            assert not await state.client.exists(keys.lease("r1"))
        await state.close()


def test_the_command_refuses_without_redis_or_with_a_bad_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text('[local_backend]\nenabled = "off"\n')
    argv = ["fleet", "heartbeat", "--config", str(config), "--name", "r1"]
    assert stackpin([*argv, "--replica-url", "http://127.0.0.1:9"]) == 2
    assert "needs Redis" in capsys.readouterr().err
    assert stackpin([*argv, "--replica-url", "127.0.0.1:9", "--redis", REDIS_URL]) == 2
    assert "--replica-url must start with http" in capsys.readouterr().err


async def test_beside_an_engine_the_sidecar_leases_the_stack_it_reports_under_its_kind() -> None:
    engine = EngineDocuments(documents_of("llamacpp"))
    await engine.start()
    clock = Clock()
    try:
        async with redis_prefix() as prefix, aiohttp.ClientSession() as session:
            keys = FleetKeys(prefix)
            state = FleetState(connect(REDIS_URL, timeout_s=2), keys)
            heartbeat = Heartbeat(
                state, session, name="cpp", replica_url=engine.url, lease_s=15, timeout_s=2.0, clock=clock,
                kind=kind_named("llamacpp"),
            )  # fmt: skip
            assert await heartbeat.beat() is Beat.PROVED
            lease = Lease.model_validate_json(await state.client.get(keys.lease("cpp")))
            assert lease.kind == "llamacpp" and lease.stack["engine"]["name"] == "llama.cpp"
            engine.documents["/props"] = {**engine.documents["/props"], "total_slots": 8}
            assert await heartbeat.beat() is Beat.CHANGED, "a restart with more slots is another stack"
            await state.close()
    finally:
        await engine.stop()


def test_the_sidecar_refuses_a_kind_whose_stack_is_declared(capsys: pytest.CaptureFixture[str]) -> None:
    code = stackpin(
        ["fleet", "heartbeat", "--replica-url", "http://127.0.0.1:1", "--name", "r", "--kind", "upstream",
         "--redis", REDIS_URL]
    )  # fmt: skip
    assert code == 2 and "its stack is declared in configuration" in capsys.readouterr().err
