"""How stored state reaches the audit database: one engine to read on, one to write on, and a database that fails
either way is `StoreUnavailable` (the middleware answers 503 with Retry-After, as for the log).

On SQLite the writer holds one connection and begins IMMEDIATE, so that a transaction that reads and then writes
(a claim of a job) never upgrades its lock midway: one writer at a time, across the proxy's processes too. On
PostgreSQL reads and writes share one small pool, and a claim takes its row with SELECT ... FOR UPDATE SKIP LOCKED, so that
proxies never wait for each other's jobs. The schema is the migrations' (the store opened first has checked it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from proxy.audit import StoreUnavailable
from proxy.audit.database import make_engine, parse_url
from proxy.audit.errors import failure_reason


@dataclass(frozen=True)
class StateDatabase:
    reader: AsyncEngine
    writer: AsyncEngine

    @classmethod
    def open(cls, url: str, *, schema: str | None = None) -> StateDatabase:
        parsed = parse_url(url)
        reader = make_engine(parsed, schema=schema, writer=False)
        if parsed.get_backend_name() != "sqlite":
            return cls(reader=reader, writer=reader)  # one small pool: reads and writes alike
        return cls(reader=reader, writer=make_engine(parsed, schema=schema, writer=True))

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        try:
            async with self.reader.connect() as connection:
                yield connection
        except (DBAPIError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"stored state cannot be read ({failure_reason(exc)})") from exc

    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncConnection]:
        """One transaction: committed when the block ends, rolled back when it raises."""
        try:
            async with self.writer.begin() as connection:
                yield connection
        except IntegrityError:
            raise  # the caller's to judge: a row that exists already is no outage
        except (DBAPIError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"stored state cannot be written ({failure_reason(exc)})") from exc

    async def close(self) -> None:
        if self.writer is not self.reader:
            await self.writer.dispose()
        await self.reader.dispose()
