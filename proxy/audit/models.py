"""The audit database's tables as SQLAlchemy 2.0 typed declarative models.

These models describe the schema that the Alembic migrations in `migrations/versions/` create; they never
create it themselves (only the migrations do, and a test checks that both agree). The `entries` table's header
columns come from the declaration of an entry's header (header.py). An entry's bytes are
`entries.py`'s business, the tree's hashing `merkle.py`'s; writing is `commit.py` (sequencing) and
`integrate.py` (the tree and its checkpoints), reading `store.py` and `tree.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Sequence,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

from proxy.audit.header import HEADER, HeaderField

# Constraint names are fixed so that migrations can name what they drop.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always aware and in UTC in Python, whatever the database keeps.

    SQLite stores no zone and hands back naive values; the chain hashes the instant, so both sides must agree.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("audit timestamps must carry a time zone")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Stack(Base):
    """A serving stack, stored once: its canonical JSON hashes to its fingerprint. Whether it was declared or
    proved is said by each entry that names it, where it is hashed."""

    __tablename__ = "stacks"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    canonical_json: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime)


class Prompt(Base):
    """A prompt text as it was sent, stored once under the SHA-256 of its UTF-8 bytes."""

    __tablename__ = "prompts"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(Text)


# PostgreSQL hands out sequence numbers in blocks of this many, one block per group commit: the entries of a batch
# get contiguous numbers without a lock shared by the proxies (SQLite has one writer at a time anyway).
SEQUENCE_BLOCK = 1024
ENTRY_SEQUENCE = Sequence("entries_seq", increment=SEQUENCE_BLOCK, start=1, metadata=Base.metadata)


def header_columns(fields: Iterable[HeaderField]) -> list[Column[Any]]:
    """The `entries` columns of an entry's declared header fields (header.py), in their order."""
    return [
        Column(
            f.name,
            _column_type(f),
            *([ForeignKey(f.references)] if f.references else []),
            nullable=f.nullable,
        )
        for f in fields
    ]


def _column_type(field: HeaderField) -> TypeEngine[Any]:
    if field.type is str:
        return String(field.max_length)
    if field.type is bool:
        return Boolean()
    return UTCDateTime()


def choice_constraints(fields: Iterable[HeaderField]) -> list[CheckConstraint]:
    """A field that allows only some values (a Literal) holds no other in its column either."""
    return [
        CheckConstraint(f"{f.name} IN ({', '.join(repr(choice) for choice in f.choices)})", name=f.name)
        for f in fields
        if f.choices is not None
    ]


ENTRIES = Table(
    "entries",
    Base.metadata,
    Column("seq", BigInteger, primary_key=True, autoincrement=False),
    *header_columns(HEADER),
    Column("content", Text, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("prev_sha256", String(64), nullable=True),  # only on entries written as a hash chain
    # The log's receipt for the entry (receipts.py), signed before it was committed; no hash covers it, and
    # entries appended without the log's key (or before receipts) have none.
    Column("receipt", Text, nullable=True),
    *choice_constraints(HEADER),
    CheckConstraint("seq > 0", name="seq"),
    Index("ix_entries_record_id", "record_id"),
    # A record has at most one entry of each part, except flags, which may accumulate.
    Index(
        "uq_entries_record_part",
        "record_id",
        "part",
        unique=True,
        sqlite_where=text("part <> 'flag'"),
        postgresql_where=text("part <> 'flag'"),
    ),
    Index("ix_entries_tenant_created", "tenant", "created_at"),
    Index("ix_entries_fingerprint_created", "fingerprint", "created_at"),
    Index("ix_entries_model_created", "model", "created_at"),
    Index("ix_entries_replica_created", "replica", "created_at"),
    Index("ix_entries_created_at", "created_at"),
    Index("ix_entries_replay_of_created", "replay_of", "created_at"),
)


class Entry(Base):
    """One entry of the log, written once; a record is the entries that share its record id. Its header's columns
    are the declared header fields (header.py), then its content, its `sha256`, and a chained entry's link."""

    __table__ = ENTRIES


class Payload(Base):
    """An entry's payload (the request and the answer), kept beside the log: its canonical JSON and the salt that
    `entries.payload_sha256` hashes with it. Erased (the row deleted) by an erasure entry (erasure.py) when its
    tenant's retention ends or on request; the entry, its leaf and every proof stay. The entry's tenant and time
    are repeated here so that finding what a retention policy erases walks only payloads still kept."""

    __tablename__ = "payloads"
    __table_args__ = (Index("ix_payloads_tenant_created", "tenant", "created_at"),)

    seq: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("entries.seq"), primary_key=True, autoincrement=False
    )
    tenant: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    salt: Mapped[str] = mapped_column(String(64))  # hex
    payload: Mapped[str] = mapped_column(Text)


class LogQueue(Base):
    """Batches committed but not yet in the tree: entries `first_seq` to `first_seq + count - 1`, with the leaf
    hashes their writer computed, 64 hex digits each, in order (None: compute them from the entries)."""

    __tablename__ = "log_queue"

    first_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    count: Mapped[int] = mapped_column(Integer)
    leaf_hashes: Mapped[str | None] = mapped_column(Text)


class LogLeaf(Base):
    """The tree's order and its leaves: leaf `leaf_index` (from 0) is the entry `seq`, with its hash."""

    __tablename__ = "log_leaves"

    leaf_index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(BigInteger, ForeignKey("entries.seq"), unique=True)
    leaf_hash: Mapped[str] = mapped_column(String(64))


class TreeNode(Base):
    """Every perfect subtree's hash above the leaves: node (level, idx), level >= 1, covers leaves
    [idx * 2**level, (idx + 1) * 2**level). Level 0 is `log_leaves.leaf_hash`."""

    __tablename__ = "tree_nodes"

    level: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    idx: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    hash: Mapped[str] = mapped_column(String(64))


class LogCheckpoint(Base):
    """A signed checkpoint (C2SP tlog-checkpoint); `root_hash` in hex repeats the note's, for queries."""

    __tablename__ = "checkpoints"

    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    root_hash: Mapped[str] = mapped_column(String(64))
    note: Mapped[str] = mapped_column(Text)
    signed_at: Mapped[datetime] = mapped_column(UTCDateTime)
