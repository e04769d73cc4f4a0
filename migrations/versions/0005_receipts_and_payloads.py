"""Receipts, and payloads kept beside the log so that they can be erased.

`entries.receipt` holds the log's signed promise to integrate each entry (proxy/audit/receipts.py).
`entries.payload_sha256` is the hash an entry's leaf commits to instead of its payload (the request and the
answer): SHA-256 of a salt and the payload's canonical JSON, both kept in `payloads`, one row per entry, until a
retention policy or a request erases them. Entries written before keep their bytes: their payload is in their
content, their `payload_sha256` null, which their bytes never held (a field absent while null, header.py).

Only columns are added and a table made, so the upgrade takes no time whatever the log's size; the downgrade
drops what was added, and refuses while an entry holds its payload apart (its bytes would lose their meaning).

Revision ID: 0005_receipts_and_payloads
Revises: 0004_transparency_log
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_receipts_and_payloads"
down_revision: str | None = "0004_transparency_log"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("entries", sa.Column("receipt", sa.Text(), nullable=True))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        # In place (SQLite 3.35 and later): copying the table, as batch mode would, breaks the foreign keys
        # that name it.
        op.execute("ALTER TABLE entries DROP COLUMN receipt")
    else:
        op.drop_column("entries", "receipt")
