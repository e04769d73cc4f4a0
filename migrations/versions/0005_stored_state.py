"""State that outlives a request: jobs with leases (background responses and batches), a background stream's events,
files, a batch's answered lines, conversations and their items (proxy/state/tables.py).

Nothing of the log changes: these tables sit beside it.

Revision ID: 0005_stored_state
Revises: 0004_transparency_log
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_stored_state"
down_revision: str | None = "0004_transparency_log"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHEN = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("request", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("started_at", WHEN, nullable=True),
        sa.Column("finished_at", WHEN, nullable=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("lease_until", WHEN, nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.CheckConstraint("kind IN ('response', 'batch')", name="ck_jobs_kind"),
        sa.CheckConstraint("state IN ('queued', 'running', 'finished')", name="ck_jobs_state"),
    )
    op.create_index("ix_jobs_state_created", "jobs", ["state", "created_at"])
    op.create_index("ix_jobs_tenant_kind_created", "jobs", ["tenant", "kind", "created_at"])
    op.create_table(
        "job_events",
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("n", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "n", name="pk_job_events"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name="fk_job_events_job_id_jobs"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_tenant_created", "files", ["tenant", "created_at"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("record_id", sa.String(100), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
        sa.ForeignKeyConstraint(["batch_id"], ["jobs.id"], name="fk_batch_lines_batch_id_jobs"),
    )
    op.create_table(
        "conversations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("metadata", sa.Text(), nullable=False),
        sa.Column("deleted_at", WHEN, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_conversations"),
    )
    op.create_index("ix_conversations_tenant_created", "conversations", ["tenant", "created_at"])
    op.create_table(
        "conversation_items",
        sa.Column("conversation_id", sa.String(64), nullable=False),
        sa.Column("position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("item_id", sa.String(64), nullable=False),
        sa.Column("item", sa.Text(), nullable=False),
        sa.Column("record_id", sa.String(100), nullable=True),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("deleted_at", WHEN, nullable=True),
        sa.PrimaryKeyConstraint("conversation_id", "position", name="pk_conversation_items"),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversations.id"],
            name="fk_conversation_items_conversation_id_conversations",
        ),
        sa.UniqueConstraint("conversation_id", "item_id", name="uq_conversation_items_conversation_id"),
    )


def downgrade() -> None:
    # Dropping a table drops its indexes.
    for table in ("conversation_items", "conversations", "batch_lines", "files", "job_events", "jobs"):
        op.drop_table(table)
