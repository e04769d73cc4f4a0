"""Exporting the log for an auditor's own tools: every entry created in a time window, page by page, each with its
bytes, its leaf, its inclusion proof in one checkpoint, its payload and salt while kept, and its receipt.

Synchronous functions over a `Connection` (the store runs them through `run_sync`, one page at a time): a page is
one keyset query over the entries' time index, and the proofs of its entries are read in one more query, so an
export of any size holds one page in memory. Which nodes a proof needs is `merkle.py`'s; writing the rows out is
the command's (proxy/commands/export.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, or_, select

from proxy.audit.header import format_timestamp
from proxy.audit.merkle import inclusion_ranges, leaf_hash, nodes_for, range_hash
from proxy.audit.models import Entry, LogLeaf, Payload
from proxy.audit.tree import b64, read_nodes, stored_fields
from proxy.audit.values import SignedCheckpoint

ENTRIES = Entry.__table__
LEAVES = LogLeaf.__table__
PAYLOADS = Payload.__table__
PAGE_SIZE = 256  # entries in memory at once; a long stream's `closed` entry can be megabytes


@dataclass(frozen=True)
class Window:
    """Which entries an export holds: created in [since, until), of one tenant or of all."""

    since: datetime
    until: datetime | None = None
    tenant: str | None = None


def page(
    connection: Connection,
    window: Window,
    checkpoint: SignedCheckpoint | None,
    after: tuple[datetime, int] | None,
    limit: int = PAGE_SIZE,
) -> tuple[list[dict[str, Any]], tuple[datetime, int] | None]:
    """The next `limit` entries of `window` after `after` (created_at, seq), oldest first, as export rows, and
    where the page after them starts (None: they were the last)."""
    query = (
        select(
            ENTRIES,
            LEAVES.c.leaf_index,
            PAYLOADS.c.payload.label("payload_text"),
            PAYLOADS.c.salt.label("payload_salt"),
        )
        .select_from(
            ENTRIES.outerjoin(LEAVES, LEAVES.c.seq == ENTRIES.c.seq).outerjoin(
                PAYLOADS, PAYLOADS.c.seq == ENTRIES.c.seq
            )
        )
        .where(ENTRIES.c.created_at >= window.since)
        .order_by(ENTRIES.c.created_at, ENTRIES.c.seq)
        .limit(limit)
    )
    if window.until is not None:
        query = query.where(ENTRIES.c.created_at < window.until)
    if window.tenant is not None:
        query = query.where(ENTRIES.c.tenant == window.tenant)
    if after is not None:
        moment, seq = after
        query = query.where(
            or_(ENTRIES.c.created_at > moment, and_(ENTRIES.c.created_at == moment, ENTRIES.c.seq > seq))
        )
    rows = connection.execute(query).mappings().all()
    size = 0 if checkpoint is None else checkpoint.tree_size
    proven = {int(r["leaf_index"]) for r in rows if r["leaf_index"] is not None and r["leaf_index"] < size}
    ranges = {index: inclusion_ranges(index, size) for index in proven}
    nodes = read_nodes(connection, set().union(*(nodes_for(r) for r in ranges.values()))) if ranges else {}
    cursor = (rows[-1]["created_at"], int(rows[-1]["seq"])) if len(rows) == limit else None
    return [_row(row, size, ranges, nodes) for row in rows], cursor


def _row(row: Any, size: int, ranges: dict[int, Any], nodes: dict[Any, bytes]) -> dict[str, Any]:
    text = stored_fields(row).text()
    index = None if row["leaf_index"] is None else int(row["leaf_index"])
    proof = None if index not in ranges else [b64(range_hash(span, nodes)) for span in ranges[index]]
    return {
        "record_id": row["record_id"],
        "seq": int(row["seq"]),
        "part": row["part"],
        "tenant": row["tenant"],
        "created_at": format_timestamp(row["created_at"]),
        "status": row["status"],
        "model": row["model"],
        "fingerprint": row["fingerprint"],
        "replica": row["replica"],
        "entry": text,
        "leaf_hash": b64(leaf_hash(text.encode("utf-8"))),
        "leaf_index": index,
        "tree_size": size,
        "proof": proof,
        "payload": row["payload_text"],
        "salt": row["payload_salt"],
        "payload_erased": row["payload_sha256"] is not None and row["payload_text"] is None,
        "receipt": row["receipt"],
    }


COLUMNS = (
    "record_id",
    "seq",
    "part",
    "tenant",
    "created_at",
    "status",
    "model",
    "fingerprint",
    "replica",
    "entry",
    "leaf_hash",
    "leaf_index",
    "tree_size",
    "proof",
    "payload",
    "salt",
    "payload_erased",
    "receipt",
)
