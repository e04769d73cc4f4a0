"""Stream ends the store was away for: held, committed once the store is back, dropped when already closed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from proxy.audit import SealedEntry
from proxy.serving.unclosed import Unclosed
from tests.support.audit_databases import POSTGRES_URL, audit_database, entry
from tests.support.tcp_relay import TcpRelay

pytestmark = pytest.mark.postgres


def closed(record_id: str) -> SealedEntry:
    return entry(record_id, part="closed", status="interrupted")


async def test_ends_are_held_while_the_store_is_away_and_committed_once_it_is_back(tmp_path: Path) -> None:
    postgres = make_url(POSTGRES_URL)
    relay = TcpRelay(postgres.host or "127.0.0.1", postgres.port or 5432)
    await relay.start()
    async with audit_database("postgres", tmp_path) as database:
        await database.migrate()
        database.url = database.url.replace(
            f"{postgres.host}:{postgres.port}", f"127.0.0.1:{relay.listen_port}"
        )
        store = await database.open(signer=None)
        try:
            for record_id in ("a", "b"):
                await store.append(entry(record_id, part="opened", status="streaming"))
            unclosed = Unclosed(store, retry_s=0.05)
            await relay.cut()
            unclosed.hold(closed("a"))
            unclosed.hold(closed("b"))
            assert await unclosed.commit() == 0
            assert unclosed.held == ["a", "b"], "what the store could not take stays held"

            await relay.start()
            running = asyncio.create_task(unclosed.run())
            try:
                async with asyncio.timeout(30):
                    while unclosed.held:
                        await asyncio.sleep(0.05)
            finally:
                running.cancel()
            records = [await store.get_record(record_id, None) for record_id in ("a", "b")]
            assert [r.status if r else None for r in records] == ["interrupted", "interrupted"]

            unclosed.hold(closed("a"))
            assert await unclosed.commit() == 0 and unclosed.held == [], "an end already recorded is dropped"
        finally:
            await store.close()
            await relay.close()


async def test_at_most_limit_ends_are_held(tmp_path: Path) -> None:
    async with audit_database("postgres", tmp_path) as database:
        await database.migrate()
        store = await database.open(signer=None)
        try:
            unclosed = Unclosed(store, limit=2)
            for record_id in ("a", "b", "c"):
                unclosed.hold(closed(record_id))
            assert unclosed.held == ["a", "b"]
        finally:
            await store.close()
