"""The local services the proxy benchmarks start and tear down: free ports, trivial replicas in processes of their
own, a fresh PostgreSQL schema, a Redis key prefix no other run uses, a throwaway key for the audit log.

Each is an async context manager that leaves nothing behind (processes stopped, the schema dropped, the prefix's
keys deleted). The servers are those the tests use, named by the same variables. This module knows nothing of what
a benchmark measures.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import aiohttp
import asyncpg
import redis

POSTGRES_URL = os.environ.get(
    "STACKPIN_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("STACKPIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_until_up(url: str, timeout_s: float = 60) -> None:
    """Until `url` answers 200; raises after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@asynccontextmanager
async def trivial_replicas(count: int, *, stream_events: int = 8) -> AsyncIterator[list[str]]:
    """`count` trivial replicas (bench/trivial_replica.py), each in its own process; yields their base URLs."""
    ports = [free_port() for _ in range(count)]
    command = [sys.executable, "-m", "bench.trivial_replica", "--stream-events", str(stream_events)]
    processes = [subprocess.Popen([*command, str(port)]) for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            await wait_until_up(f"{url}/v1/stack")
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


@asynccontextmanager
async def postgres_schema(prefix: str, url: str = POSTGRES_URL) -> AsyncIterator[str]:
    """A fresh schema in the PostgreSQL at `url` (an SQLAlchemy URL), dropped with everything in it at the end."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f'CREATE SCHEMA "{schema}"')
        yield schema
    finally:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await connection.close()


@contextmanager
def redis_prefix() -> Iterator[str]:
    """A key prefix no other run uses in the Redis at REDIS_URL; its keys are deleted at the end (never FLUSHDB)."""
    prefix = f"stackpin-bench-{uuid.uuid4().hex[:12]}:"
    yield prefix
    with redis.Redis.from_url(REDIS_URL) as client:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.unlink(key)


def log_key_environment() -> dict[str, str]:
    """Environment variables that give a proxy a throwaway signing key for its audit log (a PostgreSQL store
    needs one; never a production key)."""
    from proxy.audit.note import generate_signer

    signer = generate_signer(f"bench.local/{uuid.uuid4().hex[:8]}")
    return {"STACKPIN_LOG__SIGNING_KEY_ENV": "STACKPIN_BENCH_LOG_KEY", "STACKPIN_BENCH_LOG_KEY": signer.text}
