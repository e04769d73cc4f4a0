"""Jobs: work that outlives the request that asked for it (a background response, a batch), run by whichever proxy
claims it, under a lease.

A job is `queued` until a proxy claims it: in one transaction it takes the oldest job that is queued, or running
under a lease that has run out (its proxy stopped, or lost the database), with SELECT ... FOR UPDATE SKIP LOCKED on
PostgreSQL (a single writer on SQLite), and marks it `running` under its own lease until `now + lease_s`. The proxy
renews its leases while it runs; a job whose lease ran out is taken up again by any proxy, and one taken up more
than `max_attempts` times is finished as `failed` instead: never lost, never run forever. A job ends `finished`
with an outcome (`completed`, `failed`, `cancelled`). Cancelling a queued job finishes it at once; a running one is
asked to stop (`cancel_requested`), and its proxy sees that when it renews. Only the lease's holder may change a
running job. What a job does is its kind's business (proxy/state/runner.py); this module keeps the rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection

from proxy.state.database import StateDatabase
from proxy.state.tables import JOBS

OUTCOMES = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class Job:
    id: str
    kind: str
    tenant: str
    state: str  # queued, running, finished
    outcome: str | None
    cancel_requested: bool
    request: dict[str, Any]
    detail: dict[str, Any]
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    owner: str | None
    lease_until: datetime | None
    attempts: int


def _job(row: RowMapping) -> Job:
    values = dict(row)
    values["request"] = json.loads(values["request"])
    values["detail"] = json.loads(values["detail"]) if values["detail"] else {}
    return Job(**values)


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Jobs:
    def __init__(self, db: StateDatabase) -> None:
        self._db = db

    async def create(
        self, job_id: str, kind: str, tenant: str, request: dict[str, Any], now: datetime
    ) -> Job:
        values = {"id": job_id, "kind": kind, "tenant": tenant, "state": "queued", "outcome": None,
                  "cancel_requested": False, "request": _dumps(request), "detail": None, "created_at": now,
                  "started_at": None, "finished_at": None, "owner": None, "lease_until": None, "attempts": 0}  # fmt: skip
        async with self._db.write() as connection:
            await connection.execute(JOBS.insert().values(**values))
        return _job(values)  # type: ignore[arg-type]

    async def get(self, job_id: str, tenant: str | None, kind: str | None = None) -> Job | None:
        """The job, or None when there is none of this tenant's (`tenant=None`: any) and kind."""
        query = select(JOBS).where(JOBS.c.id == job_id)
        if tenant is not None:
            query = query.where(JOBS.c.tenant == tenant)
        if kind is not None:
            query = query.where(JOBS.c.kind == kind)
        async with self._db.read() as connection:
            row = (await connection.execute(query)).mappings().one_or_none()
        return None if row is None else _job(row)

    async def listed(self, kind: str, tenant: str, *, after: str | None, limit: int) -> list[Job]:
        """The tenant's jobs of `kind`, newest first, those older than `after` when it names one."""
        query = select(JOBS).where(JOBS.c.kind == kind, JOBS.c.tenant == tenant)
        async with self._db.read() as connection:
            if after is not None:
                start = (
                    await connection.execute(select(JOBS.c.created_at, JOBS.c.id).where(JOBS.c.id == after))
                ).one_or_none()
                if start is not None:
                    query = query.where(
                        or_(JOBS.c.created_at < start.created_at,
                            and_(JOBS.c.created_at == start.created_at, JOBS.c.id < start.id))
                    )  # fmt: skip
            rows = await connection.execute(
                query.order_by(JOBS.c.created_at.desc(), JOBS.c.id.desc()).limit(limit)
            )
            return [_job(row) for row in rows.mappings()]

    async def claim(self, owner: str, now: datetime, lease_s: float) -> Job | None:
        """Takes the oldest job that is queued or whose lease ran out, under `owner`'s lease; None if none is."""
        claimable = (
            select(JOBS.c.id)
            .where(JOBS.c.state != "finished", or_(JOBS.c.lease_until.is_(None), JOBS.c.lease_until < now))
            .order_by(JOBS.c.created_at, JOBS.c.id)
            .limit(1)
            .with_for_update(skip_locked=True)
        )
        async with self._db.write() as connection:
            job_id = (await connection.execute(claimable)).scalar_one_or_none()
            if job_id is None:
                return None
            await connection.execute(
                update(JOBS)
                .where(JOBS.c.id == job_id)
                .values(state="running", owner=owner, lease_until=now + timedelta(seconds=lease_s),
                        attempts=JOBS.c.attempts + 1, started_at=func.coalesce(JOBS.c.started_at, now))
            )  # fmt: skip
            return await self._reread(connection, job_id)

    async def renew(self, owner: str, job_ids: list[str], now: datetime, lease_s: float) -> dict[str, bool]:
        """Extends `owner`'s leases on `job_ids`; for each it still holds, whether it was asked to stop."""
        if not job_ids:
            return {}
        held = and_(JOBS.c.id.in_(job_ids), JOBS.c.owner == owner, JOBS.c.state == "running")
        async with self._db.write() as connection:
            await connection.execute(
                update(JOBS).where(held).values(lease_until=now + timedelta(seconds=lease_s))
            )
            rows = await connection.execute(select(JOBS.c.id, JOBS.c.cancel_requested).where(held))
            return {row.id: row.cancel_requested for row in rows}

    async def cancels(self, owner: str) -> set[str]:
        """The jobs `owner` holds that their clients asked to cancel."""
        query = select(JOBS.c.id).where(
            JOBS.c.owner == owner, JOBS.c.state == "running", JOBS.c.cancel_requested
        )
        async with self._db.read() as connection:
            return set((await connection.execute(query)).scalars())

    async def save_detail(self, job_id: str, owner: str, detail: dict[str, Any]) -> bool:
        """Replaces the job's detail, if `owner` still holds it."""
        async with self._db.write() as connection:
            result = await connection.execute(
                update(JOBS)
                .where(JOBS.c.id == job_id, JOBS.c.owner == owner, JOBS.c.state == "running")
                .values(detail=_dumps(detail))
            )
            return bool(result.rowcount)

    async def finish(
        self, job_id: str, owner: str | None, outcome: str, detail: dict[str, Any], now: datetime
    ) -> bool:
        """Ends the job with `outcome`, if `owner` holds it (None: a job nobody holds, queued); whether it did."""
        assert outcome in OUTCOMES, outcome
        where = [JOBS.c.id == job_id, JOBS.c.state != "finished"]
        where.append(JOBS.c.owner == owner if owner is not None else JOBS.c.state == "queued")
        async with self._db.write() as connection:
            result = await connection.execute(
                update(JOBS).where(*where).values(state="finished", outcome=outcome, detail=_dumps(detail),
                                                  finished_at=now, owner=None, lease_until=None)
            )  # fmt: skip
            return bool(result.rowcount)

    async def release(self, owner: str) -> None:
        """Lets go of every lease `owner` holds (a graceful stop): its jobs are anyone's to take up again, now, and
        this time does not count among their attempts, which bound the runs that a proxy's crash cut short."""
        async with self._db.write() as connection:
            await connection.execute(
                update(JOBS)
                .where(JOBS.c.owner == owner, JOBS.c.state == "running")
                .values(owner=None, lease_until=None, attempts=JOBS.c.attempts - 1)
            )

    async def request_cancel(self, job_id: str, tenant: str, now: datetime) -> Job | None:
        """A queued job is cancelled at once; a running one is asked to stop. The job as it is now."""
        async with self._db.write() as connection:
            base = [JOBS.c.id == job_id, JOBS.c.tenant == tenant]
            await connection.execute(
                update(JOBS).where(*base, JOBS.c.state == "queued")
                .values(state="finished", outcome="cancelled", finished_at=now, cancel_requested=True)
            )  # fmt: skip
            await connection.execute(
                update(JOBS).where(*base, JOBS.c.state == "running").values(cancel_requested=True)
            )
            row = (await connection.execute(select(JOBS).where(*base))).mappings().one_or_none()
        return None if row is None else _job(row)

    @staticmethod
    async def _reread(connection: AsyncConnection, job_id: str) -> Job:
        row = (await connection.execute(select(JOBS).where(JOBS.c.id == job_id))).mappings().one()
        return _job(row)
