"""Serving is fair: fast, long streams through the proxy do not hold up another client's requests.

The upstream is a process of its own that streams as fast as a socket takes it (tests/fast_upstream.py), so that
the proxy's relay always finds events already buffered. Another client meanwhile sends a request every 20 ms and
measures each from when it was due. The figures, measured apart from the test suite, are in
bench/results/fairness.md.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from tests.proxy_harness import Harness, running_proxy

STREAM = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
async def fast_upstream() -> AsyncIterator[str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.fast_upstream", "--chunks", "2500", stdout=asyncio.subprocess.PIPE
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):
            yield (await process.stdout.readline()).decode().strip()
    finally:
        process.terminate()
        await process.wait()


async def latencies_ms(harness: Harness, until: Callable[[], bool]) -> list[float]:
    """A /healthz every 20 ms until `until()`, each timed from when it was due, as a client would see it."""
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, due: float) -> float:
        async with session.get(f"{harness.url}/healthz") as response:
            await response.read()
        return (loop.time() - due) * 1000

    async with aiohttp.ClientSession() as session:
        started, sent = loop.time(), []
        while not until():
            due = started + len(sent) * 0.02
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent.append(asyncio.create_task(one(session, due)))
        return list(await asyncio.gather(*sent))


async def drain(harness: Harness) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{harness.v1}/chat/completions", json=STREAM) as response,
    ):
        return sum([len(chunk) async for chunk in response.content.iter_any()])


async def test_long_fast_streams_do_not_starve_another_client(fast_upstream: str, tmp_path: Path) -> None:
    replicas = [{"name": "fast", "url": fast_upstream}]
    async with running_proxy([], tmp_path, replicas=replicas) as harness:
        loop = asyncio.get_running_loop()
        quiet_until = loop.time() + 0.5
        unloaded = statistics.median(await latencies_ms(harness, lambda: loop.time() > quiet_until))
        streams = [asyncio.create_task(drain(harness)) for _ in range(8)]
        loaded = await latencies_ms(harness, lambda: all(s.done() for s in streams))
        sizes = await asyncio.gather(*streams)
    assert all(size > 2500 * 200 for size in sizes), "every stream was relayed whole"
    # Measured here: about 10 ms with the relay yielding between events, about 700 ms without.
    assert statistics.median(loaded) < unloaded + 250, (unloaded, statistics.median(loaded))
