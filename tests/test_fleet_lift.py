"""Lifting a quarantine (`stackpin fleet lift NAME`): an operator's act, the only way a quarantine ends in a fleet.

Every proxy puts the replica back in rotation at its next sync, registered with the stack it proves next; the
records it marked stay marked. A proxy lifts only a quarantine it has seen in Redis and that is gone from it, so a
view read before its own quarantine was published cannot lift that quarantine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from proxy.commands.cli import main as stackpin
from tests.support.audit_databases import audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import REDIS_URL, Fleet, running_fleet
from tests.test_fleet_sync import CHAT, flags_of

pytestmark = pytest.mark.redis


def lift_argv(fleet: Fleet, folder: Path, name: str, *extra: str) -> list[str]:
    config = folder / "operator.toml"
    config.write_text(f'[local_backend]\nenabled = "off"\n\n[fleet]\nkey_prefix = "{fleet.prefix}"\n')
    return ["fleet", "lift", name, "--config", str(config), "--redis", REDIS_URL, *extra]


async def quarantine_after_one_answer(fleet: Fleet, replica: FakeReplica) -> str:
    """r1 answers once, then its sidecar proves another stack: quarantined everywhere, that record marked."""
    _, _, headers = await fleet.proxies[0].post("/v1/chat/completions", CHAT)
    fleet.clock.advance(1)
    replica.stack = {**replica.stack, "quantisation": "bf16"}
    await fleet.beat()
    await fleet.sync_all()
    assert all(p.proxy.registry.live() == [] for p in fleet.proxies)
    assert await flags_of(fleet) == [headers["Stackpin-Record"]]
    return headers["Stackpin-Record"]


async def test_a_lifted_quarantine_returns_the_replica_to_every_proxy_under_the_stack_it_proves_next(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}) as fleet:
            marked = await quarantine_after_one_answer(fleet, replica)
            argv = lift_argv(fleet, tmp_path, "r1", "--json")
            assert await asyncio.to_thread(stackpin, argv) == 0
            lifted = json.loads(capsys.readouterr().out)
            assert lifted["lifted"] == "r1" and lifted["quarantine"]["reason"] == "stack_changed"
            keys = fleet.state.keys
            assert not await fleet.state.client.exists(
                keys.quarantine("r1"), keys.flagged("r1"), keys.registered("r1")
            )

            await fleet.beat()  # the sidecar registers the stack the replica serves now
            await fleet.sync_all()
            for proxy in fleet.proxies:
                (live,) = proxy.proxy.registry.live()
                assert live.name == "r1" and live.fingerprint == replica.fingerprint
                status, _, reply = await proxy.post("/v1/chat/completions", CHAT)
                assert status == 200 and reply["Stackpin-Stack"] == replica.fingerprint
            assert await flags_of(fleet) == [marked], "the marked record stays marked, alone"


async def test_a_proxy_that_syncs_before_the_sidecar_beats_again_neither_requarantines_nor_marks_anew(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}) as fleet:
            marked = await quarantine_after_one_answer(fleet, replica)
            assert await asyncio.to_thread(stackpin, lift_argv(fleet, tmp_path, "r1")) == 0
            assert "lifted the quarantine on r1 (stack_changed" in capsys.readouterr().out
            await fleet.sync_all()  # the old lease, which proved another stack than registered, is gone
            keys = fleet.state.keys
            assert not await fleet.state.client.exists(keys.quarantine("r1"))
            assert all(p.proxy.registry.live() == [] for p in fleet.proxies), "out until the sidecar beats"
            assert await flags_of(fleet) == [marked]
            await fleet.beat()
            await fleet.sync_all()
            assert all(len(p.proxy.registry.live()) == 1 for p in fleet.proxies)


async def test_an_unreadable_quarantine_note_is_lifted_and_shown_as_it_is(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}, proxies=1) as fleet:
            await fleet.state.client.set(fleet.state.keys.quarantine("r1"), "not json")
            assert await asyncio.to_thread(stackpin, lift_argv(fleet, tmp_path, "r1")) == 0
            assert "an unreadable note: not json" in capsys.readouterr().out
            assert not await fleet.state.client.exists(fleet.state.keys.quarantine("r1"))


async def test_lifting_a_replica_without_a_quarantine_exits_2_and_removes_nothing(
    replica: FakeReplica, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"r1": replica}, proxies=1) as fleet:
            assert await asyncio.to_thread(stackpin, lift_argv(fleet, tmp_path, "r1")) == 2
            assert "r1 has no quarantine in the fleet; nothing lifted" in capsys.readouterr().err
            assert await fleet.state.client.exists(fleet.state.keys.registered("r1"))


async def test_a_view_read_before_a_quarantine_was_published_does_not_lift_it(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("sqlite", tmp_path) as db:
        await db.migrate()
        async with running_fleet(db, {"a": replica, "b": twin}, proxies=1) as fleet:
            await fleet.sync_all()
            sync = fleet.sync(0)
            before = await fleet.state.read(sync.proxy_id, fleet.clock().timestamp())
            replica.failure = "wrong_fingerprint"
            status, _, _ = await fleet.proxies[0].post("/v1/chat/completions", CHAT)
            assert status == 200, "retried on the twin"
            assert fleet.proxies[0].proxy.registry.get("a").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]
            await sync.apply(before)
            assert fleet.proxies[0].proxy.registry.get("a").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]
            await fleet.sync_all()  # sees it in Redis; still quarantined
            assert fleet.proxies[0].proxy.registry.get("a").quarantined == "fingerprint_mismatch"  # type: ignore[union-attr]


def test_the_command_refuses_without_redis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "stackpin.toml"
    config.write_text('[local_backend]\nenabled = "off"\n')
    assert stackpin(["fleet", "lift", "r1", "--config", str(config)]) == 2
    assert "fleet lift needs Redis" in capsys.readouterr().err
    assert stackpin(["fleet", "lift", "r1", "--config", str(config), "--redis", "http://x"]) == 2
    assert "--redis must start with redis://" in capsys.readouterr().err
