"""An entry's header, declared once (proxy/audit/header.py): the `entries` table's columns, the hashed header and
sealing's checks all follow the declaration, so a field declared there is in all of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Boolean, String

from proxy.audit import InvalidEntry
from proxy.audit.entries import load_canonical
from proxy.audit.header import HEADER, HEADER_NAMES, EntryHeader, declared, header_fields
from proxy.audit.models import Entry, UTCDateTime, header_columns
from tests.support.audit_databases import entry

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
# seal computes payload_sha256 from the payload it is given (64 hex digits, always within its bound).
TEXTS = [f for f in HEADER if f.type is str and f.name != "payload_sha256"]


def _column_of(column: Any) -> tuple[Any, ...]:
    """What a column is, in the terms of a declared field: type (and length), nullability, what it references."""
    kind = column.type
    length = kind.length if isinstance(kind, String) else None
    references = tuple(key.target_fullname for key in column.foreign_keys)
    return type(kind), length, column.nullable, references


def _declared_as(f: Any) -> tuple[Any, ...]:
    kind = {str: String, bool: Boolean, datetime: UTCDateTime}[f.type]
    return kind, f.max_length, f.nullable, (f.references,) if f.references else ()


def test_the_entries_table_holds_each_declared_field_as_declared() -> None:
    columns = list(Entry.__table__.columns)
    assert [c.name for c in columns[1 : 1 + len(HEADER)]] == list(HEADER_NAMES), "after seq, in their order"
    for f in HEADER:
        assert _column_of(Entry.__table__.c[f.name]) == _declared_as(f), f.name
    assert [c.name for c in columns if c.name not in HEADER_NAMES] == [
        "seq",
        "content",
        "sha256",
        "prev_sha256",
        "receipt",
    ]


def test_an_entry_hashes_every_declared_field_and_a_chained_one_those_it_held() -> None:
    sealed = entry("r1", stack_declared=True)
    held = tuple(f.name for f in HEADER if not (f.absent_when_null and getattr(sealed, f.name) is None))
    assert tuple(sealed.header()) == held
    assert set(load_canonical(sealed.encoded.decode())) == {*held, "content"}
    never_chained = {f.name for f in HEADER if not f.chained}
    assert "stack_declared" in never_chained, "the hash chain's entries never held it"
    assert set(sealed.header(chained=True)) == set(held) - never_chained
    assert sealed.header()["created_at"] == "2026-01-02T03:04:05.678901Z", "written as declared"


@dataclass(frozen=True, slots=True, kw_only=True)
class WithExample(EntryHeader):
    """A field added to a log that already holds entries: their rows hold None there, and their bytes no key."""

    example: str | None = field(
        default=None, metadata=declared(max_length=50, chained=False, absent_when_null=True)
    )


def test_a_field_declared_once_is_a_column_and_a_hashed_member() -> None:
    added = header_fields(WithExample)[-1]
    assert (added.name, added.type, added.nullable, added.max_length) == ("example", str, True, 50)
    (column,) = [c for c in header_columns(header_fields(WithExample)) if c.name == "example"]
    assert _column_of(column) == (String, 50, True, ())
    made = WithExample(**_values(), example="eu")
    assert made.header()["example"] == "eu" and made.values()["example"] == "eu"
    assert "example" not in made.header(chained=True)
    assert made.within_bounds() and not WithExample(**_values(), example="e" * 51).within_bounds()


def test_a_field_added_later_leaves_the_bytes_of_entries_without_it_as_they_were() -> None:
    before = EntryHeader(**_values())
    after = WithExample(**_values())
    assert after.header() == before.header() and after.header(chained=True) == before.header(chained=True)
    assert after.values() == {**before.values(), "example": None}, "its column holds None"


def _values() -> dict[str, Any]:
    return {name: None for name in HEADER_NAMES} | {
        "record_id": "r1",
        "part": "answer",
        "tenant": "acme",
        "created_at": T0,
        "status": "complete",
    }


@pytest.mark.parametrize("declared_field", TEXTS, ids=[f.name for f in TEXTS])
def test_sealing_holds_every_declared_text_to_its_bound(declared_field: Any) -> None:
    name, bound = declared_field.name, declared_field.max_length
    with pytest.raises(InvalidEntry, match=f"^{name} must be "):
        entry(**{"record_id": "r1", "with_stack": False, name: "x" * (bound + 1)})
    with pytest.raises(InvalidEntry, match=f"^{name} must "):
        entry(**{"record_id": "r1", "with_stack": False, name: ""})


def test_a_declaration_the_table_could_not_hold_is_refused() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Unbounded(EntryHeader):
        note: str = field(metadata=declared())

    @dataclass(frozen=True, kw_only=True)
    class Counted(EntryHeader):
        tokens: int = field(metadata=declared())

    @dataclass(frozen=True, kw_only=True)
    class Required(EntryHeader):
        region: str = field(metadata=declared(max_length=50, absent_when_null=True))

    with pytest.raises(TypeError, match="note: text needs a max_length"):
        header_fields(Unbounded)
    with pytest.raises(TypeError, match="tokens: int is not str, bool, datetime or a Literal"):
        header_fields(Counted)
    with pytest.raises(TypeError, match="region: absent when null, so it must allow None"):
        header_fields(Required)
