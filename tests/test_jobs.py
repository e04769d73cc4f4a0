"""Jobs and their leases, on SQLite and PostgreSQL: the oldest claimable job is claimed once however many proxies
claim at once, a lease that runs out makes it anyone's again, only its holder may change or finish it, and
cancelling finishes a queued job at once and asks a running one to stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from proxy.state.store import StateStore
from tests.support.audit_databases import KINDS, audit_database

T0 = datetime(2026, 12, 3, 4, 5, 6, tzinfo=UTC)
LEASE_S = 10.0


@pytest.fixture(params=KINDS)
async def state(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StateStore]:
    async with audit_database(request.param, tmp_path) as db:
        await db.migrate()
        store = StateStore.open(db.url, schema=db.schema)
        try:
            yield store
        finally:
            await store.close()


async def test_each_job_is_claimed_once_oldest_first_however_many_claim_at_once(state: StateStore) -> None:
    for i in range(6):
        await state.jobs.create(f"job-{i}", "response", "local", {"n": i}, T0 + timedelta(seconds=i))
    claims = await asyncio.gather(*(state.jobs.claim(f"proxy-{i}", T0, LEASE_S) for i in range(10)))
    claimed = [job for job in claims if job is not None]
    assert sorted(job.id for job in claimed) == [f"job-{i}" for i in range(6)], "every job once, none twice"
    assert all(job.state == "running" and job.attempts == 1 for job in claimed)
    assert await state.jobs.claim("late", T0, LEASE_S) is None


async def test_a_lease_that_runs_out_makes_the_job_anyone_s_and_only_its_holder_may_end_it(
    state: StateStore,
) -> None:
    await state.jobs.create("job", "batch", "local", {}, T0)
    first = await state.jobs.claim("a", T0, LEASE_S)
    assert first is not None and first.lease_until == T0 + timedelta(seconds=LEASE_S)
    assert await state.jobs.renew("a", ["job"], T0 + timedelta(seconds=5), LEASE_S) == {"job": False}
    assert await state.jobs.claim("b", T0 + timedelta(seconds=14), LEASE_S) is None, "renewed: still a's"
    taken = await state.jobs.claim("b", T0 + timedelta(seconds=16), LEASE_S)
    assert taken is not None and (taken.owner, taken.attempts) == ("b", 2)
    assert await state.jobs.renew("a", ["job"], T0 + timedelta(seconds=16), LEASE_S) == {}, "a lost it"
    assert not await state.jobs.save_detail("job", "a", {"x": 1})
    assert not await state.jobs.finish("job", "a", "completed", {}, T0)
    assert await state.jobs.finish("job", "b", "completed", {"done": True}, T0 + timedelta(seconds=17))
    done = await state.jobs.get("job", "local")
    assert done is not None and (done.state, done.outcome, done.detail, done.owner) == (
        "finished", "completed", {"done": True}, None,
    )  # fmt: skip
    assert await state.jobs.claim("c", T0 + timedelta(days=1), LEASE_S) is None, "finished jobs stay finished"


async def test_a_released_lease_is_anyone_s_at_once(state: StateStore) -> None:
    await state.jobs.create("job", "batch", "local", {}, T0)
    assert await state.jobs.claim("a", T0, LEASE_S) is not None
    await state.jobs.release("a")
    taken = await state.jobs.claim("b", T0, LEASE_S)
    assert taken is not None and taken.owner == "b" and taken.attempts == 1, (
        "a graceful stop is no failed attempt"
    )


async def test_cancelling_finishes_a_queued_job_and_asks_a_running_one_to_stop(state: StateStore) -> None:
    await state.jobs.create("queued", "response", "local", {}, T0)
    await state.jobs.create("running", "response", "local", {}, T0 + timedelta(seconds=1))
    cancelled = await state.jobs.request_cancel("queued", "local", T0)
    assert cancelled is not None and (cancelled.state, cancelled.outcome) == ("finished", "cancelled")
    running = await state.jobs.claim("a", T0, LEASE_S)
    assert running is not None and running.id == "running"
    assert await state.jobs.request_cancel("running", "other-tenant", T0) is None
    asked = await state.jobs.request_cancel("running", "local", T0)
    assert asked is not None and (asked.state, asked.cancel_requested) == ("running", True)
    assert await state.jobs.cancels("a") == {"running"}
    assert await state.jobs.renew("a", ["running"], T0, LEASE_S) == {"running": True}


async def test_jobs_are_listed_newest_first_per_tenant_and_kind(state: StateStore) -> None:
    for i in range(5):
        await state.jobs.create(f"b{i}", "batch", "t", {}, T0 + timedelta(seconds=i))
    await state.jobs.create("r", "response", "t", {}, T0)
    await state.jobs.create("other", "batch", "u", {}, T0)
    assert [j.id for j in await state.jobs.listed("batch", "t", after=None, limit=3)] == ["b4", "b3", "b2"]
    assert [j.id for j in await state.jobs.listed("batch", "t", after="b2", limit=3)] == ["b1", "b0"]
    assert await state.jobs.get("r", "t", kind="batch") is None and await state.jobs.get("r", "u") is None
