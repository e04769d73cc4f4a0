"""Alembic glue: bring the audit database to a revision, and tell which revision it is at.

The migrations themselves are in the `migrations` package; this module finds them through
`migrations.__file__`, so no alembic.ini is needed and `stackpin db upgrade` works from an installed wheel.
Whether an outdated schema is an error is the store's decision (`AuditStore.open`), not this module's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

import migrations
from proxy.audit.database import connect_args, create_private, make_engine, parse_url
from proxy.audit.errors import SchemaError

HEAD_REVISION = "0006_receipts_and_payloads"
# PostgreSQL names advisory locks by number; this one serialises stackpin migrations of one database.
MIGRATION_LOCK = 0x53544B50


def alembic_config(url: str | None = None, *, schema: str | None = None) -> Config:
    """A Config pointing at the packaged migrations; the URL travels in attributes, never through ini text."""
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if url is not None:
        parsed = parse_url(url)
        create_private(parsed)  # before Alembic's engine would make it with the process's umask
        config.attributes["url"] = parsed
        config.attributes["connect_args"] = connect_args(parsed, schema)
    return config


def script_head() -> str | None:
    """The head revision of the migrations shipped with this stackpin."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> set[str]:
    """Every revision the shipped migrations define."""
    return {script.revision for script in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def upgrade_database(url: str, revision: str = "head", *, schema: str | None = None) -> None:
    """Migrates the database at `url` to `revision` (Alembic command API); not inside an event loop.

    `schema` (PostgreSQL only) is the schema that holds the tables; default the server's search_path.
    """
    _refuse_running_loop("upgrade_database")
    command.upgrade(alembic_config(url, schema=schema), revision)


def downgrade_database(url: str, revision: str, *, schema: str | None = None) -> None:
    _refuse_running_loop("downgrade_database")
    command.downgrade(alembic_config(url, schema=schema), revision)


def lock_for_migration(connection: Connection) -> None:
    """Inside a transaction: waits until no other stackpin migrates this database.

    PostgreSQL takes a transaction-scoped advisory lock; on SQLite the store's BEGIN IMMEDIATE already shuts
    out every other writer.
    """
    if connection.dialect.name == "postgresql":
        require_schema(connection)
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})


def require_schema(connection: Connection) -> None:
    """PostgreSQL: refuses a search path that names no existing schema, which would fail later and obscurely."""
    if connection.dialect.name != "postgresql":
        return
    if connection.execute(text("SELECT current_schema()")).scalar() is None:
        path = connection.execute(text("SHOW search_path")).scalar()
        raise SchemaError(
            f"no schema of the search path ({path}) exists in this PostgreSQL database; "
            "create it first (CREATE SCHEMA ...) or name an existing one"
        )


def _refuse_running_loop(name: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"{name} runs its own event loop; inside one, await upgrade_database_async instead")


def _upgrade_on(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)


def _revision_on(connection: Connection) -> tuple[str | None, bool]:
    """The revision stamped in the database, and whether it holds any table at all."""
    require_schema(connection)
    revision = MigrationContext.configure(connection).get_current_revision()
    return revision, bool(inspect(connection).get_table_names())


async def inspect_database(url: str, *, schema: str | None = None) -> tuple[str | None, bool]:
    """(revision, has_tables) of the database at `url`."""
    engine = make_engine(parse_url(url), schema=schema, writer=True, pooled=False)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(_revision_on)
    finally:
        await engine.dispose()


async def schema_revision(url: str, *, schema: str | None = None) -> str | None:
    """The Alembic revision of the database at `url`; None when it was never migrated."""
    revision, _ = await inspect_database(url, schema=schema)
    return revision


def _create_if_empty_on(connection: Connection) -> bool:
    lock_for_migration(connection)
    revision, has_tables = _revision_on(connection)
    if revision is not None or has_tables:
        return False  # another process made it while this one waited, or it is not ours to touch
    _upgrade_on(connection, "head")
    return True


async def create_schema_if_empty(url: str, *, schema: str | None = None) -> bool:
    """Migrates the database to head if it holds no table at all; whether it did. Safe to race."""
    engine = make_engine(parse_url(url), schema=schema, writer=True, pooled=False)
    try:
        async with engine.begin() as connection:
            return await connection.run_sync(_create_if_empty_on)
    finally:
        await engine.dispose()


async def upgrade_database_async(url: str, revision: str = "head", *, schema: str | None = None) -> None:
    """`upgrade_database` for callers that already run an event loop."""
    engine = make_engine(parse_url(url), schema=schema, writer=True, pooled=False)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_upgrade_on, revision)
            await connection.commit()
    finally:
        await engine.dispose()
