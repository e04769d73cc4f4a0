"""A background stream's events, kept as they are sent, so that a client can read them from any proxy, while the
response runs and after, and pick up where it left off (`starting_after`, OpenAI's sequence numbers).

`EventSink` is where the serving path writes a background stream (proxy/serving/sinks.py's protocol): each event's
exact text is kept under its `sequence_number`, a few at a time (at most `FLUSH_S` apart, and at the end), so that
a long stream costs one write per batch of events rather than one per token. The record of the response holds the
same events (its `closed` entry); these rows are what a reader follows before that entry exists.
"""

from __future__ import annotations

import time

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from proxy.state.database import StateDatabase
from proxy.state.stored_responses import sequence_number
from proxy.state.tables import JOB_EVENTS

FLUSH_S = 0.05
PAGE = 1000


class JobEvents:
    def __init__(self, db: StateDatabase) -> None:
        self._db = db

    async def add(self, job_id: str, events: list[tuple[int, str]]) -> None:
        rows = [{"job_id": job_id, "n": n, "text": text} for n, text in events]
        try:
            async with self._db.write() as connection:
                await connection.execute(JOB_EVENTS.insert(), rows)
        except (
            IntegrityError
        ):  # kept already by a proxy that ran the job before: one at a time, keep what is new
            for row in rows:
                try:
                    async with self._db.write() as connection:
                        await connection.execute(JOB_EVENTS.insert().values(**row))
                except IntegrityError:
                    continue

    async def after(self, job_id: str, n: int) -> list[tuple[int, str]]:
        """The job's events after sequence number `n`, in order (a page of them)."""
        query = (
            select(JOB_EVENTS.c.n, JOB_EVENTS.c.text)
            .where(JOB_EVENTS.c.job_id == job_id, JOB_EVENTS.c.n > n)
            .order_by(JOB_EVENTS.c.n)
            .limit(PAGE)
        )
        async with self._db.read() as connection:
            return [(row.n, row.text) for row in await connection.execute(query)]


class EventSink:
    """Where the serving path writes a background stream: every event kept, in order, by its sequence number."""

    def __init__(self, events: JobEvents, job_id: str) -> None:
        self._events = events
        self._job_id = job_id
        self._held: list[tuple[int, str]] = []
        self._last = -1
        self._flushed_at = time.monotonic()

    async def open(self, headers: dict[str, str]) -> None:
        return None

    async def write(self, data: bytes) -> None:
        text = data.decode()
        n = sequence_number(text)
        self._last = n if n > self._last else self._last + 1  # an event without a number follows the last one
        self._held.append((self._last, text))
        if time.monotonic() - self._flushed_at >= FLUSH_S:
            await self.flush()

    async def flush(self) -> None:
        if self._held:
            held, self._held = self._held, []
            await self._events.add(self._job_id, held)
        self._flushed_at = time.monotonic()

    async def close(self) -> None:
        await self.flush()
