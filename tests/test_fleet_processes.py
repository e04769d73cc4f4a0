"""Several `stackpin serve` processes appending to one PostgreSQL log at once, with a `stackpin witness` following
one of them: one tree, every leaf once, every answered request with exactly its record in it, every checkpoint
accepted by the witness; `stackpin verify` agrees, with the witness's checkpoints.

Real processes on loopback ports, one PostgreSQL schema (STACKPIN_STORE__POSTGRES_SCHEMA) and one Redis prefix
(STACKPIN_FLEET__KEY_PREFIX) for all of them, replicas registered by `stackpin fleet heartbeat` sidecars. Each
proxy integrates in turn (PostgreSQL's advisory lock) and signs with the one test key."""

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

from tests.support.audit_databases import LOG_SIGNER, WITNESS_SIGNER, AuditDatabase, audit_database
from tests.support.fake_replica import FakeReplica
from tests.support.fleet import REDIS_URL, proxy_processes, redis_prefix

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


async def leaves_of(db: AuditDatabase) -> tuple[list[tuple[int, str, str]], int]:
    """The tree's leaves with their entries, in order, and how many entries there are in all."""
    engine = create_async_engine(
        db.url, poolclass=NullPool, connect_args={"server_settings": {"search_path": db.schema or "public"}}
    )
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(
                text(
                    "SELECT l.leaf_index, e.record_id, e.part FROM log_leaves l JOIN entries e ON e.seq = l.seq "
                    "ORDER BY l.leaf_index"
                )
            )
            count = (await connection.execute(text("SELECT count(*) FROM entries"))).scalar_one()
            return [tuple(row) for row in rows], count  # type: ignore[misc]
    finally:
        await engine.dispose()


async def test_proxies_appending_at_once_build_one_witnessed_tree_with_one_record_per_answer(
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
            witness_key, witness_store = tmp_path / "witness.key", tmp_path / "witness.jsonl"
            witness_key.write_text(WITNESS_SIGNER.text)
            log_key = LOG_SIGNER.verifier.vkey
            await processes.start(
                "witness", "--url", urls[0], "--log-key", log_key, "--store", str(witness_store),
                "--key", str(witness_key), "--interval-s", "0.2", log_name="witness",
            )  # fmt: skip
            gate = asyncio.Semaphore(24)

            async def one(session: aiohttp.ClientSession, i: int) -> tuple[str, str, bool]:
                async with gate:
                    return await send(session, urls[i % PROXIES], i)

            async with aiohttp.ClientSession() as session:
                answered = await asyncio.gather(*(one(session, i) for i in range(REQUESTS)))
            await wait_for_witness(witness_store, REQUESTS + REQUESTS // 3)
            await processes.stop_all()
            config = tmp_path / "verify.toml"
            config.write_text(f'[store]\nurl = "{db.url}"\n[local_backend]\nenabled = "off"\n')
            status, out = await processes.run(
                "verify", "--config", str(config), "--log-key", log_key, "--witness", str(witness_store),
                "--witness-key", WITNESS_SIGNER.verifier.vkey,
            )  # fmt: skip
            witness_log = processes.logs()
        assert status == 0 and "log intact" in out and "0 entries wait" in out, out
        assert "REFUSED" not in witness_log, witness_log
        leaves, count = await leaves_of(db)

    assert len(replica.requests) + len(twin.requests) == REQUESTS
    assert {url for _, url, _ in answered} == set(urls), "the load went through every proxy"
    assert [index for index, *_ in leaves] == list(range(count)), "every entry a leaf, once, none skipped"
    parts = Counter((record, part) for _, record, part in leaves)
    expected = Counter()
    for record, _, stream in answered:
        for part in ("opened", "closed") if stream else ("answer",):
            expected[(record, part)] += 1
    assert parts == expected, "every answered request has exactly its record, and nothing else is there"


async def wait_for_witness(store: Path, size: int, timeout_s: float = 60.0) -> None:
    """Until the witness has cosigned a checkpoint of `size` leaves (generous: the machine may be busy)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        lines = store.read_text().splitlines() if store.exists() else []
        if lines and json.loads(lines[-1])["tree_size"] >= size:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the witness did not reach a checkpoint of size {size}")
