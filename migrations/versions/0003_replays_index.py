"""An index for finding a record's replays (entries that name it in replay_of).

Revision ID: 0003_replays_index
Revises: 0002_listing_indexes
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0003_replays_index"
down_revision: str | None = "0002_listing_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_entries_replay_of_created", "entries", ["replay_of", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_entries_replay_of_created", table_name="entries")
