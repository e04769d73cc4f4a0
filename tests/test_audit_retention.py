"""Retention (proxy/audit/retention.py): each tenant's payloads older than its policy are erased, once or every
interval in a proxy, and nothing else is."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from proxy.audit.retention import apply_retention
from proxy.config import Settings
from tests.support.audit_databases import LOG_SIGNER, T0, audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.proxy_harness import running_proxy
from tests.test_audit_erasure import paid

NOW = T0 + timedelta(days=40)


async def test_a_tenants_payloads_past_its_days_are_erased_and_no_others(tmp_path: Path) -> None:
    async with audit_database("sqlite", tmp_path) as database:
        await database.migrate()
        store = await database.open(checkpoint_interval_s=3600)
        try:
            await store.append(paid("acme-old"))
            await store.append(paid("acme-young", seconds=timedelta(days=20).total_seconds()))
            await store.append(paid("beta-old", tenant="beta"))
            await store.append(paid("gamma-old", tenant="gamma"))
            erased = await apply_retention(store, {"acme": 30, "beta": 60}, NOW, round_size=1)
            assert [e.record_id for e in erased] == ["acme-old"]
            record = await store.get_record("acme-old", None)
            assert record is not None and record.erased
            assert record.erasures[0].content["policy"] == "retention"
            assert record.erasures[0].content["why"] == "tenant acme: retention_days = 30"
            for kept in ("acme-young", "beta-old", "gamma-old"):
                found = await store.get_record(kept, None)
                assert found is not None and not found.erased, kept
            assert await apply_retention(store, {"acme": 30, "beta": 60}, NOW) == [], "nothing left to erase"
            assert (await store.verify(verifiers=[LOG_SIGNER.verifier])).ok
        finally:
            await store.close()


def test_the_policies_are_each_tenants_days_or_the_stores_default() -> None:
    keys = {"api_key_sha256": ["ab" * 32]}
    tenants = [
        {"name": "acme", "retention_days": 30, **keys},
        {"name": "beta", "api_key_sha256": ["cd" * 32]},
    ]
    assert Settings(tenants=tenants).retention_days() == {"acme": 30}
    assert Settings(tenants=tenants, store={"retention_days": 365}).retention_days() == {
        "acme": 30,
        "beta": 365,
    }
    assert Settings(store={"retention_days": 7}).retention_days() == {"local": 7}, "no tenants: the local one"
    assert Settings().retention_days() == {}, "kept for ever unless a policy says otherwise"
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings(store={"retention_days": 0})


async def test_a_proxy_applies_retention_by_itself(replica: FakeReplica, tmp_path: Path) -> None:
    async with running_proxy(
        [replica], tmp_path, store_options={"retention_days": 30, "retention_interval_s": 0.05}
    ) as harness:
        store = harness.proxy.store
        await store.append(paid("old", tenant="local"))  # T0: long past 30 days
        status, _, headers = await harness.post(
            "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 200
        for _ in range(200):
            record = await store.get_record("old", None)
            if record is not None and record.erased:
                break
            await asyncio.sleep(0.05)
        assert record is not None and record.erased, "erased within a few intervals"
        fresh = await store.get_record(headers["Stackpin-Record"], None)
        assert fresh is not None and not fresh.erased and fresh.entries[0].payload == "kept"
