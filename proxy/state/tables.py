"""The tables of state that outlives a request: jobs run by any proxy (background responses, batches) with their
leases, a background stream's events, uploaded and produced files, a batch's answered lines, and conversations.

They live in the audit database, beside the log, and are made only by the Alembic migrations (revision
0005_stored_state); they are declared on the audit models' metadata so that one comparison holds the migrations to
every table. Unlike the log they are mutable: a job's lease moves, a conversation's items change. What must stay
provable is in the log: every answer a job gives is a record there, and a batch's own entry names its lines'
records and its files' SHA-256.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Table,
    Text,
    UniqueConstraint,
)

from proxy.audit.models import Base, UTCDateTime

ID_LENGTH = 64
TENANT_LENGTH = 200
RECORD_LENGTH = 100

JOBS = Table(
    "jobs",
    Base.metadata,
    Column("id", String(ID_LENGTH), primary_key=True),  # resp_<hex> or batch_<hex>
    Column("kind", String(16), nullable=False),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("state", String(16), nullable=False),
    Column("outcome", String(16), nullable=True),  # once finished: completed, failed, cancelled
    Column("cancel_requested", Boolean, nullable=False),
    Column("request", Text, nullable=False),  # JSON: what to run
    Column("detail", Text, nullable=True),  # JSON: what its kind keeps of its progress and result
    Column("created_at", UTCDateTime, nullable=False),
    Column("started_at", UTCDateTime, nullable=True),
    Column("finished_at", UTCDateTime, nullable=True),
    Column("owner", String(ID_LENGTH), nullable=True),  # the proxy that holds its lease
    Column("lease_until", UTCDateTime, nullable=True),
    Column("attempts", Integer, nullable=False),  # how many times a proxy took it up
    CheckConstraint("kind IN ('response', 'batch')", name="kind"),
    CheckConstraint("state IN ('queued', 'running', 'finished')", name="state"),
    Index("ix_jobs_state_created", "state", "created_at"),
    Index("ix_jobs_tenant_kind_created", "tenant", "kind", "created_at"),
)

JOB_EVENTS = Table(
    "job_events",
    Base.metadata,
    Column("job_id", String(ID_LENGTH), ForeignKey("jobs.id"), primary_key=True),
    Column("n", BigInteger, primary_key=True, autoincrement=False),  # the event's sequence_number
    Column("text", Text, nullable=False),  # exactly as the client is sent it
)

FILES = Table(
    "files",
    Base.metadata,
    Column("id", String(ID_LENGTH), primary_key=True),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(255), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Index("ix_files_tenant_created", "tenant", "created_at"),
)

BATCH_LINES = Table(
    "batch_lines",
    Base.metadata,
    Column("batch_id", String(ID_LENGTH), ForeignKey("jobs.id"), primary_key=True),
    Column("line", Integer, primary_key=True, autoincrement=False),  # from 0, in the input file's order
    Column("custom_id", Text, nullable=False),
    Column("record_id", String(RECORD_LENGTH), nullable=True),  # the answer's record; None for an error
    Column("status_code", Integer, nullable=False),
    Column("body", Text, nullable=False),  # JSON: the answer as the client would have got it, or the error
)

CONVERSATIONS = Table(
    "conversations",
    Base.metadata,
    Column("id", String(ID_LENGTH), primary_key=True),
    Column("tenant", String(TENANT_LENGTH), nullable=False),
    Column("created_at", UTCDateTime, nullable=False),
    Column("metadata", Text, nullable=False),  # JSON object
    Column("deleted_at", UTCDateTime, nullable=True),
    Index("ix_conversations_tenant_created", "tenant", "created_at"),
)

CONVERSATION_ITEMS = Table(
    "conversation_items",
    Base.metadata,
    Column("conversation_id", String(ID_LENGTH), ForeignKey("conversations.id"), primary_key=True),
    Column("position", BigInteger, primary_key=True, autoincrement=False),
    Column("item_id", String(ID_LENGTH), nullable=False),
    Column("item", Text, nullable=False),  # JSON: the item as the API shows it
    Column("record_id", String(RECORD_LENGTH), nullable=True),  # the response that added it, if one did
    Column("created_at", UTCDateTime, nullable=False),
    Column("deleted_at", UTCDateTime, nullable=True),
    UniqueConstraint("conversation_id", "item_id"),
)
