"""A batch's answered lines: for each line of its input file that is done, the record of its answer (or the error it
got) and what its output line says. A line is written once; the batch runner (proxy/state/batch_run.py) skips the
lines found here when it resumes a batch, so that no line is answered twice."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.exc import IntegrityError

from proxy.state.database import StateDatabase
from proxy.state.tables import BATCH_LINES


@dataclass(frozen=True)
class DoneLine:
    line: int  # from 0, in the input file's order
    custom_id: str
    record_id: str | None  # None: the line got an error, and no answer
    status_code: int
    body: dict[str, Any]  # the answer as a client would have got it, or the error body


class BatchLines:
    def __init__(self, db: StateDatabase) -> None:
        self._db = db

    async def done(self, batch_id: str) -> dict[int, DoneLine]:
        query = select(BATCH_LINES).where(BATCH_LINES.c.batch_id == batch_id).order_by(BATCH_LINES.c.line)
        async with self._db.read() as connection:
            rows = (await connection.execute(query)).mappings().all()
        return {
            row["line"]: DoneLine(row["line"], row["custom_id"], row["record_id"], row["status_code"],
                                  json.loads(row["body"]))
            for row in rows
        }  # fmt: skip

    async def put(self, batch_id: str, done: DoneLine) -> None:
        """Keeps a done line; a line kept already (by a proxy that ran the batch before) stays as it was."""
        values = {"batch_id": batch_id, "line": done.line, "custom_id": done.custom_id, "record_id": done.record_id,
                  "status_code": done.status_code, "body": json.dumps(done.body, ensure_ascii=False)}  # fmt: skip
        try:
            async with self._db.write() as connection:
                await connection.execute(BATCH_LINES.insert().values(**values))
        except IntegrityError:
            return

    async def counts(self, batch_id: str) -> tuple[int, int]:
        """How many lines are done with an answer, and how many with an error."""
        ok = BATCH_LINES.c.status_code < 300
        query = select(
            func.coalesce(func.sum(case((ok, 1), else_=0)), 0),
            func.coalesce(func.sum(case((ok, 0), else_=1)), 0),
        ).where(BATCH_LINES.c.batch_id == batch_id)
        async with self._db.read() as connection:
            completed, failed = (await connection.execute(query)).one()
        return int(completed), int(failed)
