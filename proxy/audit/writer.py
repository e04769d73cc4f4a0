"""Where the store's transactions run: a group commit's batch on the driver's own API, and the integrator's rounds
on a SQLAlchemy `Connection`.

A group commit is the request path: every answer waits for one. Through SQLAlchemy's execution layer a
single-entry transaction cost about 2 ms of CPU, twenty times what `sqlite3` itself spends on it, so batches run
on the raw drivers (`batch.py`, with statements compiled from the models). On SQLite that is one `sqlite3`
connection in one dedicated thread, crossed once per batch; the integrator's rounds run on that same thread and
connection through SQLAlchemy (SQLite admits one writer at a time anyway, and they are off the request path).
On PostgreSQL it is one asyncpg connection of the writer's own, opened again after the server went away; the
integrator has an engine of its own, so that a commit never waits for a round, on an event loop in a thread of
its own, so that a round never holds the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sqlite3
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import asyncpg
from sqlalchemy import Connection, create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import StaticPool

from proxy.audit.batch import Batch, Written, write_postgres, write_sqlite
from proxy.audit.errors import StoreClosed

T = TypeVar("T")
# A server that does not answer must fail its batch's callers in bounded time, not after asyncpg's default minute.
POSTGRES_CONNECT_TIMEOUT_S = 10.0


class TransactionRunner(Protocol):
    async def run(self, work: Callable[[Connection], T]) -> T:
        """Runs `work` inside one transaction that commits when it returns and rolls back when it raises."""
        ...

    async def dispose(self) -> None: ...


class BatchWriter(Protocol):
    async def write(self, batch: Batch) -> Written:
        """Writes `batch` in one transaction, committed (per the store's durability) when this returns."""
        ...

    async def scalar(self, sql: str) -> Any:
        """One value read on the writer's own connection, outside any batch (its settings, for tests)."""
        ...

    async def dispose(self) -> None: ...


class LoopThreadRunner:
    """An async engine's transactions on an event loop of its own, in a thread of its own: an integration round
    (thousands of rows, their hashes, a signature) then holds the proxy's event loop no longer than the
    interpreter's switch interval, instead of for the whole round. The engine is only ever used on that loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        # A daemon: a store never closed must not keep the process alive.
        self._thread = threading.Thread(target=self._loop.run_forever, name="audit-integration", daemon=True)
        self._thread.start()

    async def run(self, work: Callable[[Connection], T]) -> T:
        return await asyncio.wrap_future(
            asyncio.run_coroutine_threadsafe(self._in_transaction(work), self._loop)
        )

    async def _in_transaction(self, work: Callable[[Connection], T]) -> T:
        async with self._engine.begin() as connection:
            return await connection.run_sync(work)

    async def dispose(self) -> None:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._engine.dispose(), self._loop))
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()


class WriterThread:
    """One thread that runs the calls it is handed, in order, and settles each caller's future on the caller's
    event loop. Every durable commit crosses it twice, so the crossing is kept to what it must be: a C queue
    there and one `call_soon_threadsafe` back, with none of an executor's per-call future, work item and lock."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[
            tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]] | None
        ] = queue.SimpleQueue()
        self._stopped = False
        # A daemon: a store never closed must not keep the process alive.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def call(self, work: Callable[[], T]) -> T:
        if self._stopped:  # nobody would ever run it: its caller would wait forever
            raise StoreClosed("the audit store's writer has stopped")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((work, loop, future))
        return await future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            work, loop, future = call
            try:
                outcome: tuple[Any, BaseException | None] = (work(), None)
            except BaseException as exc:  # the caller's to handle, as if it had run the call itself
                outcome = (None, exc)
            # A RuntimeError: the caller's loop has closed, and nobody is left to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, *outcome)

    @property
    def stopped(self) -> bool:
        return self._stopped

    async def stop(self) -> None:
        """Lets every call handed over so far finish, then ends the thread; a later call is refused."""
        if not self._stopped:
            self._stopped = True
            self._calls.put(None)
        await asyncio.to_thread(self._thread.join)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():  # the caller gave up waiting; what its call did stands
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SqliteWriter:
    """One sqlite3 connection, opened and used only on one thread, so that each batch or round crosses threads
    once. `connect` opens it with the store's settings; `configure_engine` adds to the integrator's engine over
    it what that engine needs (its BEGIN)."""

    def __init__(
        self, connect: Callable[[], sqlite3.Connection], configure_engine: Callable[[Engine], None]
    ) -> None:
        self._connect = connect
        self._connection: sqlite3.Connection | None = None
        self._thread = WriterThread("audit-writer")
        self._engine = create_engine("sqlite://", creator=self._opened, poolclass=StaticPool)
        configure_engine(self._engine)

    def _opened(self) -> sqlite3.Connection:
        if self._connection is None:
            self._connection = self._connect()
        return self._connection

    async def write(self, batch: Batch) -> Written:
        return await self._thread.call(lambda: self._write(batch))

    def _write(self, batch: Batch) -> Written:
        connection = self._opened()
        cursor = connection.cursor()
        try:
            # IMMEDIATE takes the write lock now: a deferred transaction that reads the largest number and then
            # upgrades to a writer can fail with SQLITE_BUSY when another process writes in between.
            cursor.execute("BEGIN IMMEDIATE")
            written = write_sqlite(cursor, batch)
            cursor.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.rollback()
            raise
        finally:
            cursor.close()
        return written

    async def run(self, work: Callable[[Connection], T]) -> T:
        return await self._thread.call(lambda: self._in_transaction(work))

    def _in_transaction(self, work: Callable[[Connection], T]) -> T:
        with self._engine.begin() as connection:
            return work(connection)

    async def scalar(self, sql: str) -> Any:
        return await self._thread.call(lambda: self._opened().execute(sql).fetchone()[0])

    async def dispose(self) -> None:
        if self._thread.stopped:
            return
        try:
            await self._thread.call(self._close)
        finally:
            await self._thread.stop()

    def _close(self) -> None:
        self._engine.dispose()
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class PostgresWriter:
    """One asyncpg connection, one batch at a time. A connection that failed other than by a refusal of the
    server's (a cut, a timeout) is dropped, and the next batch connects again: so the store recovers by itself
    when the server comes back."""

    def __init__(self, connect_kwargs: dict[str, Any], server_settings: dict[str, str]) -> None:
        self._connect_kwargs = connect_kwargs
        self._server_settings = server_settings
        self._connection: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()

    async def _connected(self) -> asyncpg.Connection:
        if self._connection is None or self._connection.is_closed():
            self._connection = await asyncpg.connect(
                **self._connect_kwargs,
                server_settings=self._server_settings,
                timeout=POSTGRES_CONNECT_TIMEOUT_S,
            )
        return self._connection

    async def write(self, batch: Batch) -> Written:
        async with self._lock:
            connection = await self._connected()
            try:
                return await write_postgres(connection, batch)
            except BaseException as exc:
                if not isinstance(exc, asyncpg.PostgresError) or connection.is_closed():
                    self._drop()
                raise

    async def scalar(self, sql: str) -> Any:
        async with self._lock:
            return await (await self._connected()).fetchval(sql)

    def _drop(self) -> None:
        if self._connection is not None:
            # terminate, not close: a close waits for a server that may be gone
            self._connection.terminate()
            self._connection = None

    async def dispose(self) -> None:
        async with self._lock:
            if self._connection is not None and not self._connection.is_closed():
                await self._connection.close(timeout=POSTGRES_CONNECT_TIMEOUT_S)
            self._connection = None
