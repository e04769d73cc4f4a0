"""Listing records: which records a filter selects, a page of them newest first, and how many there are.

A record is listed by its first entry (`answer` or `opened`); its later parts (`closed`, flags) are read for the
page only. Pages are keyset pages: a page starts strictly before (or after) the first entry of a record already
shown, so that a page costs one index walk however deep it is, and appends while someone reads never shift a
page. Building the statements is this module's job; running them is the store's (`store.py`).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, field_validator
from sqlalchemy import Select, and_, case, exists, func, or_, select
from sqlalchemy.sql.elements import ColumnElement

from proxy.audit.header import ERASED, storable
from proxy.audit.models import Entry

ENTRIES = Entry.__table__
FIRST_PARTS = ("answer", "opened")
_HEX_PREFIX = re.compile(r"^[0-9a-f]{1,64}$")


class RecordFilter(BaseModel):
    """What a listing selects. `fingerprint` is a whole fingerprint or any prefix of one (`9a41c0`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str | None = None
    fingerprint: str | None = None
    model: str | None = None
    since: AwareDatetime | None = None  # inclusive
    until: AwareDatetime | None = None  # exclusive
    replays_only: bool = False
    flagged_only: bool = False
    replay_of: str | None = None

    @field_validator("tenant", "model", "replay_of")
    @classmethod
    def _storable(cls, value: str | None, info: Any) -> str | None:
        # A value no column could hold selects nothing, and sent to the database it would fail as if the database
        # were down (PostgreSQL refuses NUL in text): it is the caller's to fix.
        length = ENTRIES.c[info.field_name].type.length
        if value is not None and not storable(value, length):
            raise ValueError(
                f"{info.field_name} must be 1 to {length} characters of text without NUL characters, "
                f"got {value[:40]!r}"
            )
        return value

    @field_validator("fingerprint")
    @classmethod
    def _hex_prefix(cls, value: str | None) -> str | None:
        if value is not None and not _HEX_PREFIX.match(value):
            raise ValueError(
                f"a stack fingerprint (or its prefix) is lowercase hex, up to 64 characters; got {value!r}"
            )
        return value

    @field_validator("since", "until", mode="before")
    @classmethod
    def _zoned(cls, value: Any, info: Any) -> Any:
        if getattr(value, "tzinfo", "absent") is None:
            raise ValueError(
                f"{info.field_name} must carry a time zone (for example {info.field_name}=...+00:00)"
            )
        return value


def flagged() -> ColumnElement[bool]:
    """True for a first entry whose record carries at least one flag (an erasure is not one that flags it)."""
    flags = ENTRIES.alias("flags")
    return exists().where(
        flags.c.record_id == ENTRIES.c.record_id, flags.c.part == "flag", flags.c.status != ERASED
    )


def where(query: Select[Any], selected: RecordFilter) -> Select[Any]:
    """`query` over first entries, narrowed to what `selected` selects."""
    query = query.where(ENTRIES.c.part.in_(FIRST_PARTS))
    for column in ("tenant", "model", "replay_of"):
        wanted = getattr(selected, column)
        if wanted is not None:
            query = query.where(ENTRIES.c[column] == wanted)
    if selected.fingerprint is not None:
        if len(selected.fingerprint) == 64:
            query = query.where(ENTRIES.c.fingerprint == selected.fingerprint)
        else:  # hex only (validated), so the pattern holds no wildcard but its own
            query = query.where(ENTRIES.c.fingerprint.like(selected.fingerprint + "%"))
    if selected.since is not None:
        query = query.where(ENTRIES.c.created_at >= selected.since)
    if selected.until is not None:
        query = query.where(ENTRIES.c.created_at < selected.until)
    if selected.replays_only:
        query = query.where(ENTRIES.c.replay_of.is_not(None))
    if selected.flagged_only:
        query = query.where(flagged())
    return query


def page(
    columns: list[Any], selected: RecordFilter, *, limit: int, before: Any = None, after: Any = None
) -> Select[Any]:
    """Newest first; `before`/`after` are (created_at, seq) of a first entry on the page beside it.

    With `after` the rows come oldest first (the page just newer than the cursor); the caller reverses them.
    """
    query = where(select(*columns), selected)
    if before is not None:
        query = query.where(_earlier(*before))
    if after is not None:
        query = query.where(~_earlier(*after), ENTRIES.c.seq != after[1])
        return query.order_by(ENTRIES.c.created_at.asc(), ENTRIES.c.seq.asc()).limit(limit)
    # By time first, so that a filter on tenant, stack or model can walk its (column, created_at) index.
    return query.order_by(ENTRIES.c.created_at.desc(), ENTRIES.c.seq.desc()).limit(limit)


def _earlier(created_at: Any, seq: int) -> ColumnElement[bool]:
    return or_(
        ENTRIES.c.created_at < created_at,
        and_(ENTRIES.c.created_at == created_at, ENTRIES.c.seq < seq),
    )


def counts(selected: RecordFilter) -> Select[Any]:
    """One row: how many records the filter selects, how many of them are replays, how many are flagged."""
    return where(
        select(
            func.count(),
            func.count(ENTRIES.c.replay_of),
            func.coalesce(func.sum(case((flagged(), 1), else_=0)), 0),
        ),
        selected,
    )
