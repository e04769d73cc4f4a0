"""Indexes for listing records by tenant, stack, model, replica and time.

Revision ID: 0002_listing_indexes
Revises: 0001_chain
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002_listing_indexes"
down_revision: str | None = "0001_chain"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "ix_entries_tenant_created": ["tenant", "created_at"],
    "ix_entries_fingerprint_created": ["fingerprint", "created_at"],
    "ix_entries_model_created": ["model", "created_at"],
    "ix_entries_replica_created": ["replica", "created_at"],
    "ix_entries_created_at": ["created_at"],
}


def upgrade() -> None:
    for name, columns in INDEXES.items():
        op.create_index(name, "entries", columns)


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="entries")
