"""The audit chain: stacks, prompts, entries and the chain head.

Revision ID: 0001_chain
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_chain"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

GENESIS_SHA256 = "0" * 64


def upgrade() -> None:
    op.create_table(
        "stacks",
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("canonical_json", sa.Text(), nullable=False),
        sa.Column("declared", sa.Boolean(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("fingerprint", name="pk_stacks"),
    )
    op.create_table(
        "prompts",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name="pk_prompts"),
    )
    op.create_table(
        "entries",
        sa.Column("position", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("record_id", sa.String(100), nullable=False),
        sa.Column("part", sa.String(16), nullable=False),
        sa.Column("tenant", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replica", sa.String(200), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("fingerprint", sa.String(64), nullable=True),
        sa.Column("prompt_sha256", sa.String(64), nullable=True),
        sa.Column("replay_of", sa.String(100), nullable=True),
        sa.Column("status", sa.String(64), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("prev_sha256", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("position", name="pk_entries"),
        sa.ForeignKeyConstraint(
            ["fingerprint"], ["stacks.fingerprint"], name="fk_entries_fingerprint_stacks"
        ),
        sa.ForeignKeyConstraint(
            ["prompt_sha256"], ["prompts.sha256"], name="fk_entries_prompt_sha256_prompts"
        ),
        sa.CheckConstraint("part IN ('answer', 'opened', 'closed', 'flag')", name="ck_entries_part"),
        sa.CheckConstraint("position > 0", name="ck_entries_position"),
    )
    op.create_index("ix_entries_record_id", "entries", ["record_id"])
    op.create_index(
        "uq_entries_record_part",
        "entries",
        ["record_id", "part"],
        unique=True,
        sqlite_where=sa.text("part <> 'flag'"),
        postgresql_where=sa.text("part <> 'flag'"),
    )
    head = op.create_table(
        "chain_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chain_head"),
        sa.CheckConstraint("id = 1", name="ck_chain_head_single_row"),
    )
    op.bulk_insert(head, [{"id": 1, "position": 0, "sha256": GENESIS_SHA256}])


def downgrade() -> None:
    op.drop_table("chain_head")
    op.drop_index("uq_entries_record_part", table_name="entries")
    op.drop_index("ix_entries_record_id", table_name="entries")
    op.drop_table("entries")
    op.drop_table("prompts")
    op.drop_table("stacks")
