"""The audit log as a transparency log: sequenced entries, a Merkle tree over them, signed checkpoints.

Every chained entry stays as it was (its position becomes its sequence number, its hash and link stay) and is
queued to become a leaf, in chain order: the first integration after this migration puts entry p at leaf
p - 1, its leaf hash covering its chain envelope, and signs the first checkpoint. `stacks.declared`, which no
hash covered, goes: each entry now says whether its stack was declared (chained entries said it in their
content). The chain head goes too: the signed checkpoints replace it.

Downgrading is possible only while every entry is still a chained one.

Revision ID: 0004_transparency_log
Revises: 0003_replays_index
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_transparency_log"
down_revision: str | None = "0003_replays_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SEQUENCE_BLOCK = 1024
GENESIS_SHA256 = "0" * 64
LISTING = {
    "ix_entries_tenant_created": ["tenant", "created_at"],
    "ix_entries_fingerprint_created": ["fingerprint", "created_at"],
    "ix_entries_model_created": ["model", "created_at"],
    "ix_entries_replica_created": ["replica", "created_at"],
    "ix_entries_created_at": ["created_at"],
    "ix_entries_replay_of_created": ["replay_of", "created_at"],
}


CHECKS = {"position": "ck_entries_ck_entries_position", "seq": "ck_entries_seq"}


def _entries_table(key: str, *, chained: bool) -> sa.Table:
    """The entries table as revision 0003 (`chained`) or this one defines it, for SQLite's table copy."""
    columns = [
        sa.Column(key, sa.BigInteger(), autoincrement=False, nullable=False),
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
        sa.Column("prev_sha256", sa.String(64), nullable=not chained),
    ]
    if not chained:
        columns.insert(11, sa.Column("stack_declared", sa.Boolean(), nullable=True))
    metadata = sa.MetaData()
    for name, key_column in (("stacks", "fingerprint"), ("prompts", "sha256")):
        sa.Table(name, metadata, sa.Column(key_column, sa.String(64), primary_key=True))
    return sa.Table(
        "entries",
        metadata,
        *columns,
        sa.PrimaryKeyConstraint(key, name="pk_entries"),
        sa.ForeignKeyConstraint(
            ["fingerprint"], ["stacks.fingerprint"], name="fk_entries_fingerprint_stacks"
        ),
        sa.ForeignKeyConstraint(
            ["prompt_sha256"], ["prompts.sha256"], name="fk_entries_prompt_sha256_prompts"
        ),
        # Revision 0001 named its checks through the naming convention once more than it meant to.
        sa.CheckConstraint(
            "part IN ('answer', 'opened', 'closed', 'flag')", name="ck_entries_ck_entries_part"
        ),
        sa.CheckConstraint(f"{key} > 0", name=CHECKS[key]),
        sa.Index("ix_entries_record_id", "record_id"),
        sa.Index(
            "uq_entries_record_part",
            "record_id",
            "part",
            unique=True,
            sqlite_where=sa.text("part <> 'flag'"),
            postgresql_where=sa.text("part <> 'flag'"),
        ),
        *(sa.Index(name, *columns_) for name, columns_ in LISTING.items()),
    )


def upgrade() -> None:
    bind = op.get_bind()
    with op.batch_alter_table("entries", copy_from=_entries_table("position", chained=True)) as batch:
        batch.drop_constraint(op.f(CHECKS["position"]), type_="check")
        batch.alter_column("position", new_column_name="seq", existing_type=sa.BigInteger())
        batch.alter_column("prev_sha256", nullable=True, existing_type=sa.String(64))
        batch.add_column(sa.Column("stack_declared", sa.Boolean(), nullable=True))
        batch.create_check_constraint(op.f(CHECKS["seq"]), "seq > 0")
    # SQLite drops a column in place (3.35 and later): copying the table would break the entries' foreign key.
    if bind.dialect.name == "sqlite":
        op.execute("ALTER TABLE stacks DROP COLUMN declared")
    else:
        op.drop_column("stacks", "declared")
    op.drop_table("chain_head")
    queue = op.create_table(
        "log_queue",
        sa.Column("first_seq", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("leaf_hashes", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("first_seq", name="pk_log_queue"),
    )
    op.create_table(
        "log_leaves",
        sa.Column("leaf_index", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("leaf_hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("leaf_index", name="pk_log_leaves"),
        sa.ForeignKeyConstraint(["seq"], ["entries.seq"], name="fk_log_leaves_seq_entries"),
        sa.UniqueConstraint("seq", name="uq_log_leaves_seq"),
    )
    op.create_table(
        "tree_nodes",
        sa.Column("level", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("idx", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("level", "idx", name="pk_tree_nodes"),
    )
    op.create_table(
        "checkpoints",
        sa.Column("tree_size", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("root_hash", sa.String(64), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tree_size", name="pk_checkpoints"),
    )
    # The chain (positions 1..N, none missing), in its order, waits to become the tree's first leaves.
    last = bind.execute(sa.text("SELECT coalesce(max(seq), 0) FROM entries")).scalar_one()
    blocks = [
        {"first_seq": first, "count": min(SEQUENCE_BLOCK, last - first + 1)}
        for first in range(1, last + 1, SEQUENCE_BLOCK)
    ]
    if blocks:
        op.bulk_insert(queue, blocks)
    if bind.dialect.name == "postgresql":
        op.execute(
            f"CREATE SEQUENCE entries_seq INCREMENT BY {SEQUENCE_BLOCK} MINVALUE 1 START WITH {last + 1}"
        )


def downgrade() -> None:
    bind = op.get_bind()
    unchained = bind.execute(sa.text("SELECT count(*) FROM entries WHERE prev_sha256 IS NULL")).scalar_one()
    if unchained:
        raise RuntimeError(
            f"{unchained} entries were written to the transparency log and have no place in a hash chain: "
            "this database cannot go back below revision 0004"
        )
    if bind.dialect.name == "postgresql":
        op.execute("DROP SEQUENCE entries_seq")
    op.drop_table("checkpoints")
    op.drop_table("tree_nodes")
    op.drop_table("log_leaves")
    op.drop_table("log_queue")
    head = op.create_table(
        "chain_head",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chain_head"),
        sa.CheckConstraint("id = 1", name="ck_chain_head_single_row"),
    )
    last = bind.execute(sa.text("SELECT seq, sha256 FROM entries ORDER BY seq DESC LIMIT 1")).one_or_none()
    op.bulk_insert(
        head, [{"id": 1, "position": last[0] if last else 0, "sha256": last[1] if last else GENESIS_SHA256}]
    )
    with op.batch_alter_table("stacks") as batch:
        batch.add_column(sa.Column("declared", sa.Boolean(), nullable=False, server_default=sa.false()))
    for fingerprint, content in bind.execute(
        sa.text(
            "SELECT fingerprint, content FROM entries WHERE seq IN "
            "(SELECT min(seq) FROM entries WHERE fingerprint IS NOT NULL GROUP BY fingerprint)"
        )
    ).all():
        if json.loads(content).get("stack_declared") is True:
            bind.execute(
                sa.text("UPDATE stacks SET declared = true WHERE fingerprint = :f"), {"f": fingerprint}
            )
    with op.batch_alter_table("entries", copy_from=_entries_table("seq", chained=False)) as batch:
        batch.drop_constraint(op.f(CHECKS["seq"]), type_="check")
        batch.drop_column("stack_declared")
        batch.alter_column("prev_sha256", nullable=False, existing_type=sa.String(64))
        batch.alter_column("seq", new_column_name="position", existing_type=sa.BigInteger())
        batch.create_check_constraint(op.f(CHECKS["position"]), "position > 0")
