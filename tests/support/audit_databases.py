"""Real audit databases for the audit tests: an SQLite file in a temporary folder, or a fresh PostgreSQL schema.

Each PostgreSQL database is a schema of its own (dropped at the end), so that test runs sharing one server never
see each other's chain. The server is the one named by STACKPIN_TEST_POSTGRES_URL.
"""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from proxy.audit import AuditStore, SealedEntry, seal
from proxy.audit.batch import entry_row
from proxy.audit.models import Entry
from proxy.audit.note import COSIGNATURE, generate_signer
from proxy.audit.schema import upgrade_database_async
from proxy.canonical import CanonicalDocument

POSTGRES_URL = os.environ.get(
    "STACKPIN_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
KINDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
# The same keys every run, so that a failure can be reproduced bit for bit; never a production key.
LOG_SIGNER = generate_signer("stackpin.test/log", seed=bytes(range(32)))
WITNESS_SIGNER = generate_signer("witness.test/w1", COSIGNATURE, seed=bytes(range(100, 132)))
LOG_KEY_ENV = "STACKPIN_TEST_LOG_KEY"
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
STACK = {
    "schema": 1,
    "model": "tiny",
    "weights_sha256": "ab" * 32,
    "quantisation": "fp32",
    "hardware": "cpu-x86_64-avx512",
    "hardware_detail": {"cpu_model": "test", "isa": "avx512"},
    "kernel_mode": "batch_invariant",
    "software": {"backend": "0.1.0", "torch": "2.13.0", "cuda": None, "triton": None, "driver": None},
    "batching": {"policy": "continuous", "max_batch_size": 8, "max_step_tokens": 256, "kv_split_size": 64},
}


@dataclass
class AuditDatabase:
    kind: str
    url: str
    schema: str | None

    async def open(self, **options: Any) -> AuditStore:
        """The store, signing with the test log key unless `signer=None` is given."""
        options.setdefault("signer", LOG_SIGNER)
        return await AuditStore.open(self.url, schema=self.schema, **options)

    async def migrate(self, revision: str = "head") -> None:
        await upgrade_database_async(self.url, revision, schema=self.schema)

    async def execute(self, *statements: str) -> None:
        """Raw SQL behind the store's back: how the tests tamper with a log."""
        args = {"server_settings": {"search_path": self.schema}} if self.schema else {}
        engine = create_async_engine(self.url, poolclass=NullPool, connect_args=args)
        try:
            async with engine.begin() as connection:
                for statement in statements:
                    await connection.exec_driver_sql(statement)
        finally:
            await engine.dispose()

    async def insert_entry(self, seq: int, new: SealedEntry) -> None:
        """An entries row for `new`, as the store would write it, but outside the log: no queue, no leaf."""
        args = {"server_settings": {"search_path": self.schema}} if self.schema else {}
        engine = create_async_engine(self.url, poolclass=NullPool, connect_args=args)
        try:
            async with engine.begin() as connection:
                await connection.execute(insert(Entry), [entry_row(new, seq)])
        finally:
            await engine.dispose()

    async def scalar(self, statement: str) -> Any:
        args = {"server_settings": {"search_path": self.schema}} if self.schema else {}
        engine = create_async_engine(self.url, poolclass=NullPool, connect_args=args)
        try:
            async with engine.connect() as connection:
                return (await connection.execute(text(statement))).scalar()
        finally:
            await engine.dispose()


async def create_blank(kind: str, folder: Path) -> AuditDatabase:
    """A blank database (no tables) of `kind`; `drop` removes it."""
    if kind == "sqlite":
        path = folder / "audit.db"
        path.touch()  # an empty file is an SQLite database without tables; a missing one is no database
        return AuditDatabase(kind, f"sqlite+aiosqlite:///{path}", None)
    schema = f"audit_test_{uuid.uuid4().hex[:12]}"
    await _admin(f'CREATE SCHEMA "{schema}"')
    return AuditDatabase(kind, POSTGRES_URL, schema)


async def drop(db: AuditDatabase) -> None:
    if db.schema is not None:
        await _admin(f'DROP SCHEMA IF EXISTS "{db.schema}" CASCADE')


async def _admin(statement: str) -> None:
    engine = create_async_engine(POSTGRES_URL, poolclass=NullPool)
    try:
        async with engine.begin() as connection:
            await connection.exec_driver_sql(statement)
    finally:
        await engine.dispose()


@asynccontextmanager
async def audit_database(kind: str, folder: Path) -> AsyncIterator[AuditDatabase]:
    db = await create_blank(kind, folder)
    try:
        yield db
    finally:
        await drop(db)


def entry(
    record_id: str,
    *,
    part: str = "answer",
    tenant: str = "acme",
    seconds: float = 0.0,
    replica: str | None = "replica-a",
    with_stack: bool = True,
    **overrides: Any,
) -> SealedEntry:
    """A plausible entry, sealed as the proxy seals its own; `stack` (a JSON object) is canonicalised here, as the
    proxy's replica registry does once per stack."""
    values: dict[str, Any] = {
        "record_id": record_id,
        "part": part,
        "tenant": tenant,
        "created_at": T0 + timedelta(seconds=seconds),
        "replica": replica,
        "model": "tiny",
        "stack": STACK if with_stack else None,
        "fingerprint": None,
        "prompt_text": "You are terse.",
        "status": "complete",
        "content": {
            "request": {"messages": [{"role": "user", "content": f"hello {record_id}"}], "temperature": 0},
            "response": {"token_ids": [1, 2, 3], "token_logprobs": [-0.125, -1.5e-7, -3.25]},
        },
    }
    values.update(overrides)
    if values["stack"] is not None:
        values["stack"] = CanonicalDocument.of(values["stack"])
    return seal(**values)


class StoreLogSource:
    """A witness's view of a log straight from its store (what the proxy's log routes serve)."""

    def __init__(self, store: AuditStore) -> None:
        self.store = store

    async def checkpoint(self) -> str:
        return (await self.store.checkpoint()).note

    async def consistency(self, old: int, new: int) -> list[bytes]:
        return [base64.b64decode(h) for h in (await self.store.consistency(old, new)).proof]
