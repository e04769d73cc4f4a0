"""Receipts, and payloads kept beside the log so that they can be erased.

`entries.receipt` holds the log's signed promise to integrate each entry (proxy/audit/receipts.py).
`entries.payload_sha256` is the hash an entry's leaf commits to instead of its payload (the request and the
answer): SHA-256 of a salt and the payload's canonical JSON, both kept in `payloads`, one row per entry, until a
retention policy or a request erases them. Entries written before keep their bytes: their payload is in their
content, their `payload_sha256` null, which their bytes never held (a field absent while null, header.py).

Only columns are added and a table made, so the upgrade takes no time whatever the log's size; the downgrade
drops what was added, and refuses while an entry holds its payload apart (its bytes would lose their meaning).

Revision ID: 0006_receipts_and_payloads
Revises: 0005_stored_state
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_receipts_and_payloads"
down_revision: str | None = "0005_stored_state"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


ADDED = {"payload_sha256": sa.String(64), "receipt": sa.Text()}


def upgrade() -> None:
    for name, kind in ADDED.items():
        op.add_column("entries", sa.Column(name, kind, nullable=True))
    op.create_table(
        "payloads",
        sa.Column("seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("salt", sa.String(64), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_payloads"),
        sa.ForeignKeyConstraint(["seq"], ["entries.seq"], name="fk_payloads_seq_entries"),
    )
    op.create_index("ix_payloads_tenant_created", "payloads", ["tenant", "created_at"])


def downgrade() -> None:
    bind = op.get_bind()
    apart = bind.execute(
        sa.text("SELECT count(*) FROM entries WHERE payload_sha256 IS NOT NULL")
    ).scalar_one()
    if apart:
        raise RuntimeError(
            f"{apart} entries hold their payload apart, under its hash: this database cannot go back below "
            "revision 0006"
        )
    op.drop_index("ix_payloads_tenant_created", table_name="payloads")
    op.drop_table("payloads")
    for name in ADDED:
        if bind.dialect.name == "sqlite":
            # In place (SQLite 3.35 and later): copying the table, as batch mode would, breaks the foreign keys
            # that name it.
            op.execute(f"ALTER TABLE entries DROP COLUMN {name}")
        else:
            op.drop_column("entries", name)
