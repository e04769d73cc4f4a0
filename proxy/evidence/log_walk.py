"""Walking the audit log: every record a filter selects, newest first, one page at a time.

The store's listing pages by keyset (proxy/audit/listing.py): each page starts strictly before the last record of
the one before, so a walk holds one page at a time however long the slice, and records appended while it walks
(the replays a slice replay makes, a study's next answers) are newer than where it is and never join it. What a
record holds beyond its listing line (its content: the request, the answer, a tag) takes a read of its own, and
reads of a few records at once take about half as long as one after another.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from proxy.audit import AuditRecord, AuditStore, RecordFilter, RecordSummary

PAGE = 200
READS_AT_ONCE = 8


async def walk(
    store: AuditStore, selected: RecordFilter, *, page: int = PAGE
) -> AsyncIterator[RecordSummary]:
    before: str | None = None
    while True:
        rows = await store.list_records(selected, limit=page, before=before)
        for row in rows:
            yield row
        if len(rows) < page:
            return
        before = rows[-1].id


async def read_records(
    store: AuditStore,
    selected: RecordFilter,
    wanted: Callable[[RecordSummary], bool] = lambda _: True,
    *,
    page: int = PAGE,
    at_once: int = READS_AT_ONCE,
) -> AsyncIterator[AuditRecord]:
    """The whole records the walk finds `wanted`, in its order, read `at_once` at a time."""
    batch: list[RecordSummary] = []

    async def read(rows: list[RecordSummary]) -> list[AuditRecord | None]:
        return await asyncio.gather(*(store.get_record(row.id, selected.tenant) for row in rows))

    async for row in walk(store, selected, page=page):
        if wanted(row):
            batch.append(row)
        if len(batch) == at_once:
            for record in await read(batch):
                if record is not None:
                    yield record
            batch = []
    for record in await read(batch):
        if record is not None:
            yield record
