"""Where a group commit's transaction runs: one synchronous function, two ways to run it.

The transaction itself is written once, against a synchronous SQLAlchemy `Connection`. On PostgreSQL it runs on
the asyncpg connection through `run_sync`, which costs nothing extra. On SQLite it runs on a plain `sqlite3`
connection in one dedicated thread: aiosqlite hands every cursor call to its own thread and back, some thirty
round trips per transaction, which made a single durable append cost about 10 ms where the work itself
(statements and the WAL fsync) takes well under one. One hop per batch keeps what SQLite offers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import URL, Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import StaticPool

T = TypeVar("T")


class TransactionRunner(Protocol):
    async def run(self, work: Callable[[Connection], T]) -> T:
        """Runs `work` inside one transaction that commits when it returns and rolls back when it raises."""
        ...

    async def dispose(self) -> None: ...


class AsyncRunner:
    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def run(self, work: Callable[[Connection], T]) -> T:
        async with self._engine.begin() as connection:
            return await connection.run_sync(work)

    async def dispose(self) -> None:
        await self._engine.dispose()


class ThreadRunner:
    """One sqlite3 connection, used only from one thread, so that each batch crosses threads once."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audit-writer")

    async def run(self, work: Callable[[Connection], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._in_transaction, work)

    def _in_transaction(self, work: Callable[[Connection], T]) -> T:
        with self._engine.begin() as connection:
            return work(connection)

    async def dispose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._engine.dispose)
        self._thread.shutdown(wait=True)


def sqlite_writer_engine(url: URL, configure: Callable[[Any], None]) -> Engine:
    """A synchronous sqlite3 engine for `url` (an aiosqlite URL), with the store's connection settings."""
    engine = create_engine(
        url.set(drivername="sqlite"),
        poolclass=StaticPool,
        connect_args={"check_same_thread": False},  # created on the loop's thread, used only on the writer's
    )
    configure(engine)
    return engine
