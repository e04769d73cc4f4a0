"""The audit database's tables as SQLAlchemy 2.0 typed declarative models.

These models describe the schema that the Alembic migrations in `migrations/versions/` create; they never
create it themselves (only the migrations do, and a test checks that both agree). Hashing and verification
live in `chain.py`, reading and writing in `store.py`.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

PARTS = ("answer", "opened", "closed", "flag")

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
    """A serving stack, stored once: its canonical JSON hashes to its fingerprint."""

    __tablename__ = "stacks"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    canonical_json: Mapped[str] = mapped_column(Text)
    declared: Mapped[bool] = mapped_column(Boolean)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime)


class Prompt(Base):
    """A prompt text as it was sent, stored once under the SHA-256 of its UTF-8 bytes."""

    __tablename__ = "prompts"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    text: Mapped[str] = mapped_column(Text)


class Entry(Base):
    """One link of the chain; a record is the entries that share its record id."""

    __tablename__ = "entries"

    position: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    record_id: Mapped[str] = mapped_column(String(100), index=True)
    part: Mapped[str] = mapped_column(String(16))
    tenant: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    replica: Mapped[str | None] = mapped_column(String(200))
    model: Mapped[str | None] = mapped_column(String(200))
    fingerprint: Mapped[str | None] = mapped_column(String(64), ForeignKey("stacks.fingerprint"))
    prompt_sha256: Mapped[str | None] = mapped_column(String(64), ForeignKey("prompts.sha256"))
    replay_of: Mapped[str | None] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(64))
    content: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    prev_sha256: Mapped[str] = mapped_column(String(64))

    __table_args__ = (
        CheckConstraint("part IN ('answer', 'opened', 'closed', 'flag')", name="part"),
        CheckConstraint("position > 0", name="position"),
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


class ChainHead(Base):
    """The last entry's position and hash, in one row that every append locks and moves."""

    __tablename__ = "chain_head"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    position: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))

    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)
