"""The audit schema: made only by the Alembic migrations, which match the models, and checked when a store opens."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from proxy.audit import (
    HEAD_REVISION,
    AuditStore,
    DatabaseUrlError,
    SchemaError,
    SchemaOutdated,
    SchemaTooNew,
    schema_revision,
    upgrade_database,
)
from proxy.audit.entries import GENESIS_SHA256, chain_hash
from proxy.audit.merkle import leaf_hash, verify_inclusion
from proxy.audit.models import Base, UTCDateTime
from proxy.audit.schema import downgrade_database, script_head
from proxy.state import tables as state_tables
from tests.support.audit_databases import (
    KINDS,
    LOG_SIGNER,
    POSTGRES_URL,
    AuditDatabase,
    audit_database,
    create_blank,
    drop,
    entry,
)

TABLES = {
    "alembic_version",
    "checkpoints",
    "entries",
    "log_leaves",
    "log_queue",
    "payloads",
    "prompts",
    "stacks",
    "tree_nodes",
    # State that outlives a request (proxy/state/tables.py), declared on the same metadata.
    *(table.name for table in (state_tables.JOBS, state_tables.JOB_EVENTS, state_tables.FILES)),
    *(table.name for table in (state_tables.BATCH_LINES, state_tables.CONVERSATIONS)),
    state_tables.CONVERSATION_ITEMS.name,
}


@pytest.fixture(params=KINDS)
async def blank(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AuditDatabase]:
    async with audit_database(request.param, tmp_path) as db:
        yield db


@pytest.fixture(params=KINDS)
def blank_sync(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AuditDatabase]:
    """The same blank database for synchronous tests (the CLI's `stackpin db upgrade` runs without a loop)."""
    db = asyncio.run(create_blank(request.param, tmp_path))
    yield db
    asyncio.run(drop(db))


async def _run_sync(db: AuditDatabase, work: Any) -> Any:
    args = {"server_settings": {"search_path": db.schema}} if db.schema else {}
    engine = create_async_engine(db.url, poolclass=NullPool, connect_args=args)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(work)
    finally:
        await engine.dispose()


def test_head_revision_is_the_head_of_the_shipped_migrations() -> None:
    assert script_head() == HEAD_REVISION


def test_upgrade_database_makes_the_schema_without_an_event_loop(blank_sync: AuditDatabase) -> None:
    upgrade_database(blank_sync.url, schema=blank_sync.schema)
    assert asyncio.run(schema_revision(blank_sync.url, schema=blank_sync.schema)) == HEAD_REVISION
    upgrade_database(blank_sync.url, schema=blank_sync.schema)  # a second run has nothing to do
    assert asyncio.run(schema_revision(blank_sync.url, schema=blank_sync.schema)) == HEAD_REVISION


async def test_the_synchronous_upgrade_says_what_to_use_inside_an_event_loop(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="await upgrade_database_async"):
        upgrade_database(f"sqlite+aiosqlite:///{tmp_path / 'audit.db'}")


async def test_migrations_build_exactly_what_the_models_describe(blank: AuditDatabase) -> None:
    await blank.migrate()

    def differences(connection: Connection) -> list[Any]:
        return compare_metadata(MigrationContext.configure(connection), Base.metadata)

    assert await _run_sync(blank, differences) == []
    assert set(await _run_sync(blank, lambda c: inspect(c).get_table_names())) == TABLES
    assert await blank.scalar("SELECT count(*) FROM checkpoints") == 0


async def test_migrations_go_down_to_nothing_and_up_again(blank: AuditDatabase) -> None:
    await blank.migrate()
    await asyncio.to_thread(downgrade_database, blank.url, "base", schema=blank.schema)
    assert set(await _run_sync(blank, lambda c: inspect(c).get_table_names())) == {"alembic_version"}
    await blank.migrate()
    assert await schema_revision(blank.url, schema=blank.schema) == HEAD_REVISION


async def test_open_refuses_an_empty_database_and_names_the_command(blank: AuditDatabase) -> None:
    with pytest.raises(SchemaOutdated, match="run `stackpin db upgrade`"):
        await blank.open()
    assert await schema_revision(blank.url, schema=blank.schema) is None, "open must not migrate on its own"


async def test_open_refuses_a_missing_sqlite_file_unless_asked_to_create_one(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'typo.db'}"
    with pytest.raises(DatabaseUrlError, match="does not exist"):
        await AuditStore.open(url)
    assert not (tmp_path / "typo.db").exists()
    store = await AuditStore.open(url, create_if_empty=True)
    await store.close()
    assert await schema_revision(url) == HEAD_REVISION


async def test_create_if_empty_migrates_a_blank_database(blank: AuditDatabase) -> None:
    store = await blank.open(create_if_empty=True)
    try:
        stored = await store.append(entry("first"))
    finally:
        await store.close()
    assert stored.seq == 1
    assert await schema_revision(blank.url, schema=blank.schema) == HEAD_REVISION


async def test_proxies_starting_together_on_a_blank_database_migrate_it_once(blank: AuditDatabase) -> None:
    stores = await asyncio.gather(*(blank.open(create_if_empty=True) for _ in range(3)))
    try:
        stored = await asyncio.gather(*(store.append(entry(f"r{i}")) for i, store in enumerate(stores)))
        report = await stores[0].verify()
    finally:
        for store in stores:
            await store.close()
    assert len({s.seq for s in stored}) == 3
    assert report.ok
    assert await schema_revision(blank.url, schema=blank.schema) == HEAD_REVISION


async def test_open_refuses_an_old_schema_until_it_is_upgraded(blank: AuditDatabase) -> None:
    await blank.migrate("0001_chain")
    with pytest.raises(SchemaOutdated, match=r"at schema revision 0001_chain.*run `stackpin db upgrade`"):
        await blank.open(create_if_empty=True)
    await blank.migrate()
    store = await blank.open()
    await store.close()


async def test_open_refuses_a_schema_newer_than_this_stackpin(blank: AuditDatabase) -> None:
    await blank.migrate()
    await blank.execute("UPDATE alembic_version SET version_num = '9999_future'")
    with pytest.raises(SchemaTooNew, match=r"9999_future.*upgrade stackpin"):
        await blank.open()


async def test_create_if_empty_leaves_a_database_with_foreign_tables_alone(blank: AuditDatabase) -> None:
    await blank.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    with pytest.raises(SchemaOutdated, match="holds tables but no stackpin schema revision"):
        await blank.open(create_if_empty=True)
    assert set(await _run_sync(blank, lambda c: inspect(c).get_table_names())) == {"invoices"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mysql+aiomysql://root@127.0.0.1/audit", "'mysql\\+aiomysql', which is not supported"),
        ("sqlite+aiosqlite://", "needs an SQLite file"),
        ("sqlite+aiosqlite:///:memory:", "needs an SQLite file"),
        ("sqlite+aiosqlite:////nonexistent-folder/audit.db", "folder of the audit database"),
        ("not a url", "cannot be parsed"),
    ],
)
async def test_a_bad_database_url_says_what_would_do(url: str, message: str) -> None:
    with pytest.raises(DatabaseUrlError, match=message):
        await AuditStore.open(url)


async def test_plain_driver_names_are_accepted(tmp_path: Path) -> None:
    store = await AuditStore.open(f"sqlite:///{tmp_path / 'plain.db'}", create_if_empty=True)
    await store.close()


@pytest.mark.postgres
async def test_a_postgres_schema_that_does_not_exist_is_named() -> None:
    with pytest.raises(SchemaError, match="CREATE SCHEMA"):
        await AuditStore.open(POSTGRES_URL, schema="audit_test_missing_schema")
    with pytest.raises(SchemaError, match="audit_test_missing_schema"):
        await asyncio.to_thread(upgrade_database, POSTGRES_URL, schema="audit_test_missing_schema")


@pytest.mark.postgres
async def test_a_password_never_appears_in_a_schema_error(tmp_path: Path) -> None:
    async with audit_database("postgres", tmp_path) as db:
        with_password = make_url(db.url).set(password="hunter2").render_as_string(hide_password=False)
        with pytest.raises(SchemaOutdated) as caught:
            await AuditStore.open(with_password, schema=db.schema)
    assert "hunter2" not in str(caught.value)
    assert "***" in str(caught.value)


def _chained_tables() -> tuple[sa.Table, sa.Table, sa.Table, sa.Table]:
    """The tables as revisions 0001 to 0003 made them (the hash chain), to write a chained log as it was."""
    metadata = sa.MetaData()
    stacks = sa.Table(
        "stacks",
        metadata,
        sa.Column("fingerprint", sa.String(64), primary_key=True),
        sa.Column("canonical_json", sa.Text),
        sa.Column("declared", sa.Boolean),
        sa.Column("first_seen", UTCDateTime),
    )
    prompts = sa.Table(
        "prompts", metadata, sa.Column("sha256", sa.String(64), primary_key=True), sa.Column("text", sa.Text)
    )
    columns = [
        "record_id",
        "part",
        "tenant",
        "replica",
        "model",
        "fingerprint",
        "prompt_sha256",
        "replay_of",
        "status",
    ]
    entries = sa.Table(
        "entries",
        metadata,
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("created_at", UTCDateTime),
        *(sa.Column(name, sa.String) for name in columns),
        sa.Column("content", sa.Text),
        sa.Column("sha256", sa.String(64)),
        sa.Column("prev_sha256", sa.String(64)),
    )
    head = sa.Table(
        "chain_head",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("position", sa.BigInteger),
        sa.Column("sha256", sa.String(64)),
    )
    return stacks, prompts, entries, head


async def _write_chained_log(db: AuditDatabase, count: int) -> list[str]:
    """`count` entries chained as revision 0002's store wrote them; the first served by a declared stack."""
    stacks, prompts, entries, head = _chained_tables()
    made = [
        entry(f"old{i}", seconds=i, content={"request": {"n": i}, "stack_declared": i == 0})
        for i in range(count)
    ]
    rows, prev = [], GENESIS_SHA256
    for position, new in enumerate(made, start=1):
        digest = chain_hash(position, prev, new)
        rows.append({"position": position, "created_at": new.created_at, "content": new.content_json,
                     "sha256": digest, "prev_sha256": prev,
                     **{c: getattr(new, c) for c in ("record_id", "part", "tenant", "replica", "model",
                                                     "fingerprint", "prompt_sha256", "replay_of", "status")}})  # fmt: skip
        prev = digest
    args = {"server_settings": {"search_path": db.schema}} if db.schema else {}
    engine = create_async_engine(db.url, poolclass=NullPool, connect_args=args)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                sa.insert(stacks),
                [
                    {
                        "fingerprint": made[0].fingerprint,
                        "canonical_json": made[0].stack_json,
                        "declared": True,
                        "first_seen": made[0].created_at,
                    }
                ],
            )
            await connection.execute(
                sa.insert(prompts), [{"sha256": made[0].prompt_sha256, "text": made[0].prompt_text}]
            )
            await connection.execute(sa.insert(entries), rows)
            await connection.execute(sa.update(head).values(position=count, sha256=prev))
    finally:
        await engine.dispose()
    return [row["sha256"] for row in rows]


async def test_a_chained_log_becomes_the_tree_s_first_leaves_and_stays_verifiable(
    blank: AuditDatabase,
) -> None:
    await blank.migrate("0003_replays_index")
    hashes = await _write_chained_log(blank, 5)
    await blank.migrate()
    store = await blank.open()
    try:
        checkpoint = await store.integrate()
        old = await store.get_record("old0", tenant="acme")
        proof = await store.record_proof("old3", tenant=None)
        added = await store.append(entry("new", seconds=9))
        await store.integrate()
        report = await store.verify(verifiers=[LOG_SIGNER.verifier])
    finally:
        await store.close()
    assert checkpoint is not None and checkpoint.tree_size == 5, "the chain, integrated in its order"
    assert old is not None and old.entries[0].index == 0 and old.entries[0].sha256 == hashes[0]
    assert old.stack_declared is True, "said by the chained entry's content, which its hash covers"
    assert proof is not None and proof.entries[0].index == 3
    assert (
        proof.entries[0].entry.startswith('{"entry":') and f'"prev":"{hashes[2]}"' in proof.entries[0].entry
    )
    root = base64.b64decode(checkpoint.root_hash)
    leaf = leaf_hash(proof.entries[0].entry.encode())
    verify_inclusion(3, 5, leaf, [base64.b64decode(h) for h in proof.entries[0].proof or []], root)
    assert added.seq > 5
    assert report.ok and report.tree_size == 6, report.problem
    with pytest.raises(RuntimeError, match="cannot go back below revision 0004"):
        await asyncio.to_thread(downgrade_database, blank.url, "0003_replays_index", schema=blank.schema)


async def test_an_edited_link_of_the_migrated_chain_is_found(blank: AuditDatabase) -> None:
    await blank.migrate("0003_replays_index")
    hashes = await _write_chained_log(blank, 4)
    await blank.migrate()
    store = await blank.open()
    try:
        await store.integrate()
        await blank.execute(
            f"UPDATE entries SET prev_sha256 = '{hashes[0]}', sha256 = '{'e' * 64}' WHERE seq = 3"
        )
        report = await store.verify()
    finally:
        await store.close()
    assert report.problem is not None and (report.problem.kind, report.problem.position) == (
        "hash_mismatch",
        2,
    )
