"""Alembic's environment for the audit database: runs migrations over an async SQLAlchemy engine.

Called only through `proxy.audit.schema`, which puts what this needs into `config.attributes`: either an open
synchronous `connection` (when the caller already runs an event loop) or a `url` and optional PostgreSQL
`schema`, from which this builds its own engine. Nothing here reads the environment.
"""

from __future__ import annotations

import asyncio
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from proxy.audit.models import Base
from proxy.audit.schema import lock_for_migration
from proxy.state import tables as _state_tables  # noqa: F401  (its tables join Base.metadata)

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite changes most constraints only by copying the table; batch mode does that.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        lock_for_migration(connection)
        context.run_migrations()


async def _run_with_own_engine(url: str, connect_args: dict[str, Any]) -> None:
    engine = create_async_engine(url, poolclass=NullPool, connect_args=connect_args)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


def _main() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.attributes.get("url")
    if url is None:
        raise RuntimeError("run migrations through proxy.audit.schema (no database URL was given)")
    asyncio.run(_run_with_own_engine(url, config.attributes.get("connect_args", {})))


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported; run `stackpin db upgrade`")
_main()
