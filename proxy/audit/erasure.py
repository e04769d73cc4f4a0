"""Erasing a record's payload, by a retention policy or on request, with every proof of its entries left valid.

An entry written with a payload (the request and the answer) commits to SHA-256(salt || payload) in its bytes
(entries.py); the payload and its salt are kept beside the log, in `payloads`. Erasing a record deletes those rows
and appends one entry that says so: a `flag` (a later mark on the record), status `erased`, whose content names
each entry erased (its `seq`, `part` and the hash its leaf commits to), when, and by which policy (`retention`,
with the tenant's rule, or `request`, with the reason given). Both happen in one transaction (batch.py): the log
never holds an erasure without its deletion, nor a deletion without its erasure. The entries, their leaves, the
tree and every proof stay as they were.

A record written before payloads were kept apart holds its payload in its hashed content: erasing it would break
its proof, so it is refused (`NotErasable`), as is a record with nothing left to erase. What to erase and when is
decided here from what is stored; appending is the store's, and running a policy on a clock `retention.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Connection, select

from proxy.audit.errors import NotErasable
from proxy.audit.header import ERASED
from proxy.audit.models import Entry, Payload
from proxy.audit.sealed import SealedEntry, seal

ENTRIES = Entry.__table__
PAYLOADS = Payload.__table__


@dataclass(frozen=True)
class Policy:
    """Why a payload is erased: `retention` (`why` names the rule) or `request` (`why` is the reason given)."""

    kind: Literal["retention", "request"]
    why: str


@dataclass(frozen=True)
class Held:
    """What a record holds that an erasure concerns: its tenant, its entries whose payloads are kept
    (seq, part, payload_sha256), and whether any of its entries was ever written with its payload apart."""

    record_id: str
    tenant: str
    kept: list[tuple[int, str, str]]
    apart: bool


def held(connection: Connection, record_id: str) -> Held | None:
    """The record's erasable state; None when there is no such record."""
    rows = connection.execute(
        select(
            ENTRIES.c.seq,
            ENTRIES.c.part,
            ENTRIES.c.tenant,
            ENTRIES.c.payload_sha256,
            PAYLOADS.c.seq.label("kept"),
        )
        .select_from(ENTRIES.outerjoin(PAYLOADS, PAYLOADS.c.seq == ENTRIES.c.seq))
        .where(ENTRIES.c.record_id == record_id, ENTRIES.c.part != "flag")
        .order_by(ENTRIES.c.seq)
    ).all()
    if not rows:
        return None
    kept = [(int(r.seq), str(r.part), str(r.payload_sha256)) for r in rows if r.kept is not None]
    return Held(record_id, str(rows[0].tenant), kept, any(r.payload_sha256 is not None for r in rows))


def erasure_entry(found: Held, policy: Policy, now: datetime) -> SealedEntry:
    """The entry that erases what `found` keeps; NotErasable when there is nothing it could erase."""
    if not found.kept:
        if found.apart:
            raise NotErasable(f"record {found.record_id}'s payload is erased already")
        raise NotErasable(
            f"record {found.record_id} was written before payloads were kept apart from the log: its request and "
            "answer are hashed into its entries, and erasing them would break its proof"
        )
    erased = [{"seq": seq, "part": part, "payload_sha256": digest} for seq, part, digest in found.kept]
    content: dict[str, Any] = {
        "reason": ERASED,
        "erased": erased,
        "policy": policy.kind,
        "why": policy.why,
        "erased_at": now.isoformat(),
    }
    return seal(
        record_id=found.record_id,
        part="flag",
        tenant=found.tenant,
        created_at=now,
        status=ERASED,
        content=content,
        erases=tuple(seq for seq, _, _ in found.kept),
    )


def expired(connection: Connection, tenant: str, before: datetime, limit: int) -> list[str]:
    """Records of `tenant` with a payload kept from before `before`, oldest first, at most `limit`: an index range
    of the payloads still kept, however long the log."""
    rows = connection.execute(
        select(PAYLOADS.c.created_at, ENTRIES.c.record_id)
        .select_from(PAYLOADS.join(ENTRIES, ENTRIES.c.seq == PAYLOADS.c.seq))
        .where(PAYLOADS.c.tenant == tenant, PAYLOADS.c.created_at < before)
        .order_by(PAYLOADS.c.created_at)
        .limit(limit)
    ).all()
    return list(dict.fromkeys(str(row.record_id) for row in rows))


def erased_seqs(content: dict[str, Any]) -> set[int]:
    """The entries an erasure entry's content says it erased (none for any other flag)."""
    erased = content.get("erased")
    if content.get("reason") != ERASED or not isinstance(erased, list):
        return set()
    return {item["seq"] for item in erased if isinstance(item, dict) and isinstance(item.get("seq"), int)}
