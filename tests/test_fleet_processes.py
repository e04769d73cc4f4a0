"""Several `stackpin serve` processes appending to one PostgreSQL chain at once: no forked chain, no lost record,
no duplicate position, and every answered request has exactly one record; `stackpin verify` agrees.

Real processes on loopback ports, one PostgreSQL schema (STACKPIN_STORE__POSTGRES_SCHEMA) and one Redis prefix
(STACKPIN_FLEET__KEY_PREFIX) for all of them, replicas registered by `stackpin fleet heartbeat` sidecars."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.audit_databases import AuditDatabase, audit_database
from tests.fake_replica import FakeReplica
from tests.fleet_support import REDIS_URL, proxy_processes, redis_prefix

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

PROXIES = 3
REQUESTS = 90  # a third of them streamed


async def send(session: aiohttp.ClientSession, url: str, i: int) -> tuple[str, str, bool]:
    """One request; returns the record id, the proxy that answered, and whether it was streamed."""
    stream = i % 3 == 0
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": stream,
    }
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        record = response.headers["Stackpin-Record"]
        payload = await response.read()
    if stream:
        assert payload.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(payload)["choices"][0]["message"]["content"]
    return record, url, stream


async def entries_of(db: AuditDatabase) -> list[tuple[int, str, str, str]]:
    engine = create_async_engine(
        db.url, poolclass=NullPool, connect_args={"server_settings": {"search_path": db.schema or "public"}}
    )
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                text("SELECT position, record_id, part, prev_sha256 FROM entries ORDER BY position")
            )
            return [tuple(row) for row in rows]  # type: ignore[misc]
    finally:
        await engine.dispose()


async def test_proxies_appending_at_once_keep_one_chain_with_one_record_per_answer(
    replica: FakeReplica, twin: FakeReplica, tmp_path: Path
) -> None:
    async with audit_database("postgres", tmp_path) as db, redis_prefix() as prefix:
        await db.migrate()
        async with proxy_processes(
            tmp_path,
            proxies=PROXIES,
            replicas={"a": replica.url, "b": twin.url},
            store_url=db.url,
            schema=db.schema,
            redis_url=REDIS_URL,
            prefix=prefix,
        ) as (urls, processes):
            gate = asyncio.Semaphore(24)

            async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, str, bool]:
                async with gate:
                    return await send(session, urls[i % PROXIES], i)

            async with aiohttp.ClientSession() as session:
                answered = await asyncio.gather(*(one(session, i) for i in range(REQUESTS)))
            await processes.stop_all()
            config = tmp_path / "verify.toml"
            config.write_text(f'[store]\nurl = "{db.url}"\n[local_backend]\nenabled = "off"\n')
            status, out = await processes.run("verify", "--config", str(config))
        assert status == 0 and "chain intact" in out, out
        entries = await entries_of(db)

    assert len(replica.requests) + len(twin.requests) == REQUESTS
    assert {url for _, url, _ in answered} == set(urls), "the load went through every proxy"
    positions = [position for position, *_ in entries]
    assert positions == list(range(1, len(entries) + 1)), "one position each, none skipped or repeated"
    assert len({prev for *_, prev in entries}) == len(entries), "no two entries chain onto one predecessor"
    parts = Counter((record, part) for _, record, part, _ in entries)
    expected = Counter()
    for record, _, stream in answered:
        for part in ("opened", "closed") if stream else ("answer",):
            expected[(record, part)] += 1
    assert parts == expected, "every answered request has exactly its record, and nothing else is there"
