"""How the audit store reaches its database: URL checks, engines and per-dialect connection settings.

Knows SQLite (aiosqlite, the embedded default) and PostgreSQL (asyncpg). Knows nothing of tables or the log.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import event
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from proxy.audit.errors import DatabaseUrlError
from proxy.audit.writer import BatchWriter, LoopThreadRunner, PostgresWriter, SqliteWriter, TransactionRunner

SUPPORTED = "sqlite+aiosqlite:///path/to/audit.db or postgresql+asyncpg://user@host:5432/database"
DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}
SQLITE_BUSY_TIMEOUT_MS = 10_000


def parse_url(url: str) -> URL:
    """The async SQLAlchemy URL for `url`, or DatabaseUrlError saying what would be accepted."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        # The text is not echoed: it may hold a password.
        raise DatabaseUrlError(f"the audit database URL cannot be parsed; use {SUPPORTED}") from exc
    driver = DRIVERS.get(parsed.drivername)
    if driver is None:
        raise DatabaseUrlError(
            f"the audit database URL uses {parsed.drivername!r}, which is not supported; use {SUPPORTED}"
        )
    parsed = parsed.set(drivername=driver)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise DatabaseUrlError(
                "the audit store needs an SQLite file (an in-memory database would lose every record); "
                f"use {SUPPORTED}"
            )
        if not Path(database).parent.is_dir():
            raise DatabaseUrlError(
                f"the folder of the audit database {database!r} does not exist; "
                "create it or choose another path"
            )
    return parsed


def create_private(url: URL) -> None:
    """Creates an SQLite database file that does not exist yet, readable and writable by its owner only: it holds
    every request and answer, like the key file beside it. SQLite gives the WAL and shared-memory files it makes
    the database file's mode. An empty file is an SQLite database without tables; PostgreSQL needs nothing."""
    if url.get_backend_name() != "sqlite":
        return
    with contextlib.suppress(FileExistsError):
        os.close(os.open(url.database or "", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def describe(url: URL) -> str:
    """The URL for messages and logs: never with its password."""
    return url.render_as_string(hide_password=True)


Durability = Literal["disk", "process"]
_WAL_ATTEMPTS = 40  # about 4 s of waiting in all


def connect_args(url: URL, schema: str | None) -> dict[str, Any]:
    if url.get_backend_name() == "postgresql" and schema is not None:
        return {"server_settings": {"search_path": schema}}
    return {}


def _use_wal(cursor: Any) -> None:
    """Switch the file to WAL (it stays so). While several connections open a brand-new file at once, SQLite answers
    some of them "database is locked" at once, without waiting on the busy timeout (it would deadlock otherwise), for
    the switch and for reads alike; they try again, briefly. This runs once per connection, at start."""
    for attempt in range(_WAL_ATTEMPTS):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except Exception as e:  # the driver's OperationalError, in whichever wrapper
            if "locked" not in str(e) or attempt == _WAL_ATTEMPTS - 1:
                raise
            time.sleep(0.005 * (attempt + 1))


def configure_sqlite(dbapi_connection: Any, durability: Durability) -> None:
    """The store's settings on a new sqlite3 connection."""
    # Take transaction control from the driver so that BEGIN is ours (see _begin).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; FULL syncs the WAL on every commit, which is the durability
    # the proxy promises before it answers. NORMAL ("process") syncs at checkpoints only: a commit survives
    # the proxy's crash, not the machine's.
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    _use_wal(cursor)
    cursor.execute(f"PRAGMA synchronous={'FULL' if durability == 'disk' else 'NORMAL'}")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _begin(engine: Engine, *, immediate: bool) -> None:
    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # The writer takes the write lock up front: a deferred transaction that reads the head and then
        # upgrades to a writer can fail with SQLITE_BUSY when another process writes in between.
        connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _sqlite_settings(engine: Engine, *, immediate: bool, durability: Durability = "disk") -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        configure_sqlite(dbapi_connection, durability)

    _begin(engine, immediate=immediate)


def make_engine(url: URL, *, schema: str | None, writer: bool, pooled: bool = True) -> AsyncEngine:
    """An engine for the store: `writer` engines hold one connection and, on SQLite, begin IMMEDIATE."""
    options: dict[str, Any] = {"connect_args": connect_args(url, schema)}
    if not pooled:
        options["poolclass"] = NullPool
    elif writer:
        options.update(pool_size=1, max_overflow=0)
    else:
        options.update(pool_size=4, max_overflow=4)
    options["pool_pre_ping"] = pooled
    create_private(url)
    engine = create_async_engine(url, **options)
    if url.get_backend_name() == "sqlite":
        _sqlite_settings(engine.sync_engine, immediate=writer)
    return engine


def make_writer(url: URL, *, schema: str | None, durability: Durability = "disk") -> BatchWriter:
    """Where group commits run: a sqlite3 connection on its own thread, or an asyncpg connection of its own.

    `durability` "disk" (the default) returns from a commit once it is on disk; "process" once it is committed,
    so that it survives the proxy's crash but the last moments of commits may be lost if the machine fails
    (SQLite synchronous=NORMAL in WAL mode; PostgreSQL synchronous_commit=off, still never inconsistent).
    """
    if url.get_backend_name() == "sqlite":
        return sqlite_writer(url, durability)
    _args, kwargs = PGDialect_asyncpg().create_connect_args(url)  # what SQLAlchemy would connect with
    settings = {**connect_args(url, schema).get("server_settings", {})}
    if durability == "process":
        settings["synchronous_commit"] = "off"
    return PostgresWriter(kwargs, settings)


def sqlite_writer(url: URL, durability: Durability) -> SqliteWriter:
    database = url.database or ""
    create_private(url)

    def connect() -> sqlite3.Connection:
        # Opened on the writer's thread and used only there; closed from it too.
        connection = sqlite3.connect(database, check_same_thread=False)
        configure_sqlite(connection, durability)
        return connection

    return SqliteWriter(connect, lambda engine: _begin(engine, immediate=True))


def make_integration_runner(
    url: URL, writer: BatchWriter, *, schema: str | None, durability: Durability
) -> TransactionRunner:
    """Where the integrator's rounds run: SQLite admits one writer at a time, so they share the committer's
    thread and connection; on PostgreSQL an engine of their own, so that the committer never waits for them, on
    a thread and event loop of their own (writer.py)."""
    if isinstance(writer, SqliteWriter):
        return writer
    engine = make_engine(url, schema=schema, writer=True)
    if durability == "process":

        @event.listens_for(engine.sync_engine, "connect")
        def _asynchronous_commit(dbapi_connection: Any, _record: Any) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("SET synchronous_commit = off")
            cursor.close()

    return LoopThreadRunner(engine)
