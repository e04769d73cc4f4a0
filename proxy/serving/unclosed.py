"""Streams whose end could not be recorded because the store was away, held until the store takes their end.

Invariant 1: a stream's record ends complete or interrupted, never silently dropped. When the store fails the
`closed` entry's commit, the client is told that its stream's end is not confirmed, and the stream's end is handed
here as an `interrupted` entry (every event the client was sent, and the failure event it got instead of the end).
Held entries are tried every `retry_s` until the store takes them, and once more at a graceful stop; one that the
process ends with is left `opened`, for the next start to close (proxy/process/sweep.py). At most `limit` are held,
since each holds its stream's events in memory; past that, the start closes them, without their events.

Building the entries is the serving path's (serve.py, records.py); this module only keeps and commits them.
"""

from __future__ import annotations

import asyncio

import structlog

from proxy.audit import AuditStore, DuplicateEntry, SealedEntry, StoreClosed, StoreUnavailable

log = structlog.get_logger("stackpin.unclosed")

RETRY_S = 1.0
LIMIT = 1024


class Unclosed:
    """The held ends; `run()` is the task that commits them while the proxy serves, `commit()` one attempt."""

    def __init__(self, store: AuditStore, *, retry_s: float = RETRY_S, limit: int = LIMIT) -> None:
        self._store = store
        self._retry_s = retry_s
        self._limit = limit
        self._held: dict[str, SealedEntry] = {}

    @property
    def held(self) -> list[str]:
        """The record ids of the streams whose end is held, oldest first."""
        return list(self._held)

    def hold(self, end: SealedEntry) -> None:
        if len(self._held) >= self._limit:
            log.error("stream_end_not_held", record_id=end.record_id, held=len(self._held))
            return
        self._held[end.record_id] = end

    async def commit(self) -> int:
        """Appends every held end once; returns how many the store took. Those it could not take stay held."""
        ends = list(self._held.values())
        results = await asyncio.gather(*(self._store.append(end) for end in ends), return_exceptions=True)
        committed = 0
        for end, result in zip(ends, results, strict=True):
            if isinstance(result, StoreUnavailable | StoreClosed):
                continue
            del self._held[end.record_id]
            if isinstance(result, DuplicateEntry):  # already closed: another proxy's start marked it
                continue
            if isinstance(result, BaseException):
                log.error("stream_end_refused", record_id=end.record_id, error=str(result))
                continue
            committed += 1
        if committed:
            log.info("stream_ends_recorded_late", recorded=committed, still_held=len(self._held))
        return committed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._retry_s)
            if self._held:
                await self.commit()
