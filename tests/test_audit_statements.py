"""The group commit's statements (proxy/audit/statements.py) against the models that own the schema: the same
columns, and rows that read back as SQLAlchemy writes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.audit.models import Entry, LogQueue, Payload, Prompt, Stack
from proxy.audit.statements import PAYLOAD_ARRAYS, DialectName, commit_statements
from tests.support.audit_databases import KINDS, audit_database, entry

# The columns whose values differ between the two rows compared below, by construction.
OWN_TO_EACH_ROW = {"seq", "record_id", "sha256", "content", "receipt"}


@pytest.mark.parametrize("dialect", ["sqlite", "postgresql"])
def test_every_insert_names_every_column_of_its_model_in_order(dialect: DialectName) -> None:
    statements = commit_statements(dialect)
    for prepared, model in [
        (statements.insert_entry, Entry),
        (statements.insert_payload, Payload),
        (statements.insert_queue, LogQueue),
        (statements.insert_stack, Stack),
        (statements.insert_prompt, Prompt),
    ]:
        table = model.__table__
        assert prepared.columns == tuple(table.columns.keys()), f"{table.name} and its INSERT disagree"
        assert prepared.sql.startswith(f"INSERT INTO {table.name} ("), prepared.sql


def test_postgresqls_one_statement_batch_takes_every_entry_column_and_the_queues() -> None:
    batch = commit_statements("postgresql").insert_batch
    assert batch is not None
    entry_columns = tuple(c.name for c in Entry.__table__.columns if c.name != "seq")
    assert batch.columns == (*entry_columns, *PAYLOAD_ARRAYS, "count", "leaf_hashes")
    assert f"INSERT INTO entries ({', '.join(Entry.__table__.columns.keys())})" in batch.sql
    assert f"INSERT INTO payloads ({', '.join(Payload.__table__.columns.keys())})" in batch.sql
    assert f"INSERT INTO log_queue ({', '.join(LogQueue.__table__.columns.keys())})" in batch.sql


@pytest.mark.parametrize("kind", KINDS)
# T0 + 0.321099 s falls on a whole second: no microseconds, the form a driver's own adapter would shorten.
@pytest.mark.parametrize("seconds", [1.25, 0.321099], ids=["fraction", "whole_second"])
async def test_a_row_the_commit_writes_is_the_row_sqlalchemy_writes(
    kind: str, seconds: float, tmp_path: Path
) -> None:
    async with audit_database(kind, tmp_path) as database:
        await database.migrate()
        store = await database.open(checkpoint_interval_s=3600)
        try:
            committed = await store.append(entry("rec_commit", seconds=seconds, stack_declared=True))
        finally:
            await store.close()
        # The same entry but for its id, written by SQLAlchemy's own execution path.
        await database.insert_entry(
            committed.seq + 100, entry("rec_orm", seconds=seconds, stack_declared=True)
        )
        columns = [c.name for c in Entry.__table__.columns if c.name not in OWN_TO_EACH_ROW]
        # Read as the driver hands them back, without SQLAlchemy's types: what is stored, not what it means.
        stored = [
            await database.scalar(
                f"SELECT {column} FROM entries WHERE record_id = '{record}'"  # fixed test names, no input
            )
            for record in ("rec_commit", "rec_orm")
            for column in columns
        ]
        assert stored[: len(columns)] == stored[len(columns) :], dict(
            zip(columns, zip(stored[: len(columns)], stored[len(columns) :], strict=True), strict=True)
        )
