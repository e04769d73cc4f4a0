"""An entry's header, declared once: the fields besides its content that an entry's bytes hold and its row stores.

Each field of `EntryHeader` says where it is declared all that the log derives from it: its type and whether it
may be absent (the annotation; a `Literal` names the values allowed), its length bound, whether a chained entry's
bytes hold it (schema revisions 0001 to 0003 never hashed `stack_declared`), how the bytes write it (`created_at`
as `format_timestamp`), and which stored document it names. From these come the bounds `seal` holds an entry to
(`within_bounds`, `out_of_bounds`), the hashed header (`header()`, and so the bytes, entries.py), the `entries`
table's columns (models.py, and so the commit's statements, statements.py), a row's values (`values()`) and the
reading back of a row (tree.py). What runs on the request path is compiled once per class from the declaration.
A new hashed field is declared here, `absent_when_null` and not `chained` (the entries already written hold no such
key, and their rows will hold None); a migration adds its column, and the proxy gives its value to `seal`. This
module knows nothing of SQL, canonical JSON or hashing.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

Part = Literal["answer", "opened", "closed", "flag"]
# The status of the flag that erases a record's payload (proxy/audit/erasure.py): a mark on the record like any
# flag, but one that says what was removed, not what was found.
ERASED = "erased"
STORABLE = (str, bool, datetime)


def format_timestamp(moment: datetime) -> str:
    """ISO 8601 in UTC with microseconds and a `Z`: one spelling per instant, whatever the input's zone."""
    if moment.tzinfo is None:
        raise ValueError("timestamps in the audit log must carry a time zone")
    # isoformat, not strftime: strftime pads years below 1000 differently from one C library to another.
    return moment.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


@dataclass(frozen=True, slots=True)
class HeaderField:
    """One declared field: what `declared` was told, with its type and nullability read from its annotation."""

    name: str
    type: type  # one of STORABLE
    nullable: bool
    choices: tuple[str, ...] | None  # the values a Literal annotation allows
    max_length: int | None  # for text: at most this many characters, and at least one
    chained: bool  # whether a chained entry's bytes hold it
    written: Callable[[Any], Any] | None  # how the bytes write its value; None: as it is
    references: str | None  # "table.column" of the stored document it names
    # Whether the bytes leave it out while it is None rather than write null: how a field added to a log that
    # already holds entries keeps their bytes (their rows hold None there).
    absent_when_null: bool


def declared(
    *,
    max_length: int | None = None,
    chained: bool = True,
    written: Callable[[Any], Any] | None = None,
    references: str | None = None,
    absent_when_null: bool = False,
) -> dict[str, Any]:
    """The metadata that makes a field of `EntryHeader` (or of a class extending it) a header field: see
    `HeaderField`."""
    told = {"max_length": max_length, "chained": chained, "written": written, "references": references}
    return {"header": told | {"absent_when_null": absent_when_null}}


@cache
def header_fields(cls: type) -> tuple[HeaderField, ...]:
    """The header fields `cls` declares, in their order."""
    hints = get_type_hints(cls)
    return tuple(
        _header_field(f.name, hints[f.name], f.metadata["header"])
        for f in dataclasses.fields(cls)
        if "header" in f.metadata
    )


def _header_field(name: str, hint: Any, told: dict[str, Any]) -> HeaderField:
    args = get_args(hint)
    nullable = get_origin(hint) in (Union, types.UnionType) and type(None) in args
    base = next(a for a in args if a is not type(None)) if nullable else hint
    choices = None
    if get_origin(base) is Literal:
        choices, base = get_args(base), str
    if base not in STORABLE:
        spelled = hint.__name__ if isinstance(hint, type) else hint
        raise TypeError(f"header field {name}: {spelled} is not str, bool, datetime or a Literal of str")
    if base is str and told["max_length"] is None:
        raise TypeError(f"header field {name}: text needs a max_length (its column's length)")
    if choices is not None and max(map(len, choices)) > told["max_length"]:
        raise TypeError(f"header field {name}: a value it allows is longer than its max_length")
    if told["absent_when_null"] and not nullable:
        raise TypeError(f"header field {name}: absent when null, so it must allow None")
    return HeaderField(name, base, nullable, choices, **told)


Reader = Callable[[Any], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Compiled:
    """What is read of a class's header on the request path, compiled once per class from its declaration."""

    values: Reader  # every field as it is
    header: Reader  # every field as the bytes write it
    chained_header: Reader  # every field a chained entry's bytes held, as they write it
    within_bounds: Callable[[Any], bool]


@cache
def _compiled(cls: type) -> _Compiled:
    fields = header_fields(cls)
    return _Compiled(
        _reader(fields, written=False, chained=False),
        _reader(fields, written=True, chained=False),
        _reader(fields, written=True, chained=True),
        _compile(
            " and ".join(b for b in map(_bound, fields) if b is not None) or "True",
            {"NUL": "\x00"} | {f"choices_{f.name}": frozenset(f.choices) for f in fields if f.choices},
        ),
    )


def _compile(expression: str, namespace: dict[str, Any]) -> Any:
    """`lambda self: expression`, compiled, as dataclasses compiles `__init__`: sealing is on the request path,
    where a dict display builds in a third of the time of `dict(zip(names, attrgetter(*names)(self)))` and one
    expression checks every bound faster than a loop over the fields. Every name in `expression` is a dataclass
    field's identifier or one of `namespace`."""
    return eval(f"lambda self: {expression}", namespace)


def _reader(fields: tuple[HeaderField, ...], *, written: bool, chained: bool) -> Reader:
    writers = {f"write_{f.name}": f.written for f in fields if written and f.written is not None}
    members = []
    for f in fields:
        if chained and not f.chained:
            continue
        value = f"write_{f.name}(self.{f.name})" if f"write_{f.name}" in writers else f"self.{f.name}"
        if written and f.absent_when_null:
            members.append(f"**({{}} if self.{f.name} is None else {{{f.name!r}: {value}}})")
        else:
            members.append(f"{f.name!r}: {value}")
    reader: Reader = _compile(f"{{{', '.join(members)}}}", writers)
    return reader


def _bound(f: HeaderField) -> str | None:
    """The declared bounds of `f` as an expression, where it has any; a Literal's values are `choices_NAME`."""
    value = f"self.{f.name}"
    if f.choices is not None:
        within = f"{value} in choices_{f.name}"
    elif f.type is str:
        within = f"0 < len({value}) <= {f.max_length} and NUL not in {value}"
    else:
        return None
    return f"({value} is None or ({within}))" if f.nullable else f"({value} is not None and {within})"


def storable(value: str, max_length: int) -> bool:
    """Whether a text column of `max_length` could hold `value`: 1 to that many characters, no NUL (PostgreSQL's
    text cannot hold one) and no lone surrogate (neither driver can send one). A value that fails this names no
    stored row, and asking the database would fail as if it were down."""
    if not 0 < len(value) <= max_length or "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def out_of_bounds(header: EntryHeader) -> str | None:
    """What is wrong with the first field of `header` that is not within its declared bounds, naming it."""
    for f in header_fields(type(header)):
        value = getattr(header, f.name)
        if value is None:
            if not f.nullable:
                return f"{f.name} is required"
            continue
        if f.choices is not None and value not in f.choices:
            return f"{f.name} must be one of {sorted(f.choices)}, got {value!r}"
        if f.type is str and not 0 < len(value) <= (f.max_length or 0):
            return f"{f.name} must be 1 to {f.max_length} characters long"
        if f.type is str and "\x00" in value:
            return f"{f.name} must not contain NUL characters"
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryHeader:
    """An entry's fields but its content, declared (see the module docstring)."""

    record_id: str = field(metadata=declared(max_length=100))
    part: Part = field(metadata=declared(max_length=16))
    tenant: str = field(metadata=declared(max_length=200))
    created_at: datetime = field(metadata=declared(written=format_timestamp))
    replica: str | None = field(metadata=declared(max_length=200))
    model: str | None = field(metadata=declared(max_length=200))
    fingerprint: str | None = field(metadata=declared(max_length=64, references="stacks.fingerprint"))
    prompt_sha256: str | None = field(metadata=declared(max_length=64, references="prompts.sha256"))
    replay_of: str | None = field(metadata=declared(max_length=100))
    status: str = field(metadata=declared(max_length=64))
    # Whether the stack was declared by configuration rather than proved; None for an entry without a stack,
    # and for chained entries, whose bytes never held it (their content may).
    stack_declared: bool | None = field(default=None, metadata=declared(chained=False))
    # SHA-256 of a salt and the canonical JSON of the entry's payload (the request and the answer), which is kept
    # beside the log, not in its content, so that it can be erased and every proof stay valid; None for an entry
    # without a payload, and for every entry written before payloads were kept apart (their content holds it).
    payload_sha256: str | None = field(
        default=None, metadata=declared(max_length=64, chained=False, absent_when_null=True)
    )

    def values(self) -> dict[str, Any]:
        """Every header field's value, by name, as it is (a row's columns)."""
        return _compiled(type(self)).values(self)

    def header(self, *, chained: bool = False) -> dict[str, Any]:
        """Every header field as the entry's bytes write it; a chained entry's lacks those it never held."""
        compiled = _compiled(type(self))
        return compiled.chained_header(self) if chained else compiled.header(self)

    def within_bounds(self) -> bool:
        """Whether every field holds a value its declaration allows: text of 1 to `max_length` characters and no
        NUL (PostgreSQL's text cannot hold one), one of a Literal's values, None only where it may be absent.
        `out_of_bounds` says which field does not."""
        within: bool = _compiled(type(self)).within_bounds(self)
        return within


HEADER = header_fields(EntryHeader)
HEADER_NAMES = tuple(f.name for f in HEADER)
