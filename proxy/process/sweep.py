"""Streams left open by a proxy that stopped without closing them, closed as interrupted when a proxy starts.

Invariant 1: a stream's record ends complete or interrupted, never silently dropped. A crash (kill -9, an OOM
kill, a lost machine) ends the relay before its `closed` entry, so at start, before it serves, the proxy appends a
`closed` entry (status `interrupted`, `marked_at_start`) to every open stream that no proxy can still be relaying.
Without fleet mode the proxy is the store's only writer, so every open stream is dead. In fleet mode another proxy
may be relaying one, so only streams opened longer ago than any stream lasts (the replica timeout bounds a stream's
whole read) are marked; the others wait for a later start. Never an edit: the `opened` entry stays as it was.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

import structlog

from proxy.audit import AuditStore, DuplicateEntry
from proxy.serving.records import interrupted_at_start_entry

log = structlog.get_logger("stackpin.sweep")
MARGIN_S = 60.0  # past the replica timeout: the relay's closing commit, and clocks a little apart


def opened_before(now: datetime, *, fleet: bool, replica_timeout_s: float) -> datetime | None:
    """The newest opening that no proxy can still be relaying; None: every open stream is dead."""
    return now - timedelta(seconds=replica_timeout_s + MARGIN_S) if fleet else None


async def mark_interrupted_streams(
    store: AuditStore, now: datetime, *, fleet: bool, replica_timeout_s: float
) -> int:
    """Closes every dead open stream as interrupted; returns how many this call marked."""
    streams = await store.open_streams(
        opened_before=opened_before(now, fleet=fleet, replica_timeout_s=replica_timeout_s)
    )
    results = await asyncio.gather(
        *(store.append(interrupted_at_start_entry(stream, now)) for stream in streams), return_exceptions=True
    )
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        if not isinstance(failure, DuplicateEntry):  # a duplicate: another proxy's start marked it first
            raise failure
    marked = len(results) - len(failures)
    if streams:
        log.info("streams_marked_interrupted", marked=marked, found=len(streams))
    return marked
