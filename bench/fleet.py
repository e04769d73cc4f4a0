"""Two proxies against one PostgreSQL and one Redis, against one proxy: throughput and added latency.

Everything runs on this machine, over loopback: two fake replicas (tests/fake_replica.py, each in its own process,
answering at once, so the proxy's own cost is what is measured), `stackpin serve` processes in fleet mode with
`stackpin fleet heartbeat` sidecars, PostgreSQL as the audit store and Redis as the fleet state. Each setup gets
a fresh PostgreSQL schema and Redis prefix. For each, two runs: one request at a time (latency, compared with
the same requests sent straight to a replica: the difference is what the proxy adds), and `--concurrency`
requests at a time (throughput). Afterwards the records are counted: every answered request must have exactly
one record, and `stackpin verify` must find the chain intact; the benchmark fails otherwise.

Usage, from the repository root: python -m bench.fleet [--requests 600] [--concurrency 32] [--serial 150]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.audit_databases import create_blank, drop
from tests.fleet_support import REDIS_URL, free_port, proxy_processes, redis_prefix

BODY = {"model": "fake-model", "max_tokens": 16, "temperature": 0}


@dataclass(frozen=True)
class Run:
    seconds: float
    latencies: list[float]
    records: list[str]
    commits: dict[str, float] | None = None  # audit commit metrics over this run, summed over the proxies

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def load(urls: list[str], requests: int, concurrency: int, tag: str) -> Run:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    records: list[str] = []

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        body = {**BODY, "messages": [{"role": "user", "content": f"{tag} {i}"}]}
        async with gate:
            started = time.perf_counter()
            async with session.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"request {i} got {response.status}")
                latencies.append(time.perf_counter() - started)
                if "Stackpin-Record" in response.headers:
                    records.append(response.headers["Stackpin-Record"])

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(requests)))
        return Run(time.perf_counter() - started, latencies, records)


COMMIT_METRICS = (
    "stackpin_audit_commit_seconds_sum",
    "stackpin_audit_commit_seconds_count",
    "stackpin_audit_batch_size_sum",
)


async def commit_metrics(urls: list[str]) -> dict[str, float]:
    totals = dict.fromkeys(COMMIT_METRICS, 0.0)
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as response:
                for line in (await response.text()).splitlines():
                    name, _, value = line.partition(" ")
                    if name in totals:
                        totals[name] += float(value)
    return totals


async def with_commits(urls: list[str], requests: int, concurrency: int, tag: str) -> Run:
    before = await commit_metrics(urls)
    run = await load(urls, requests, concurrency, tag)
    after = await commit_metrics(urls)
    return Run(run.seconds, run.latencies, run.records, {k: after[k] - before[k] for k in after})


async def record_parts(url: str, schema: str) -> Counter[str]:
    engine = create_async_engine(
        url, poolclass=NullPool, connect_args={"server_settings": {"search_path": schema}}
    )
    try:
        async with engine.connect() as connection:
            rows = await connection.execute(text("SELECT record_id FROM entries WHERE part = 'answer'"))
            return Counter(row[0] for row in rows)
    finally:
        await engine.dispose()


async def start_replicas(count: int) -> tuple[list[str], list[asyncio.subprocess.Process]]:
    ports = [free_port() for _ in range(count)]
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.fleet", "--serve-replica", str(port)
        )
        for port in ports
    ]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    async with aiohttp.ClientSession() as session:
        for url in urls:
            for _ in range(200):
                try:
                    async with session.get(f"{url}/v1/stack") as response:
                        if response.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.05)
    return urls, processes


async def measure(
    proxies: int, replicas: list[str], folder: Path, args: argparse.Namespace
) -> tuple[Run, Run]:
    db = await create_blank("postgres", folder)
    from proxy.audit.schema import upgrade_database_async

    try:
        await upgrade_database_async(db.url, "head", schema=db.schema)
        async with (
            redis_prefix() as prefix,
            proxy_processes(
                folder,
                proxies=proxies,
                replicas={f"r{i}": url for i, url in enumerate(replicas)},
                store_url=db.url,
                schema=db.schema,
                redis_url=REDIS_URL,
                prefix=prefix,
                sync_interval_s=1.0,
            ) as (urls, processes),
        ):
            await load(urls, 100, args.concurrency, "warm-up")
            serial = await with_commits(urls, args.serial, 1, "serial")
            parallel = await with_commits(urls, args.requests, args.concurrency, "parallel")
            await processes.stop_all()
            config = folder / "verify.toml"
            config.write_text(f'[store]\nurl = "{db.url}"\n[local_backend]\nenabled = "off"\n')
            status, out = await processes.run("verify", "--config", str(config))
            if status != 0:
                raise RuntimeError(f"stackpin verify failed:\n{out}")
        assert db.schema is not None
        parts = await record_parts(db.url, db.schema)
        answered = Counter(serial.records + parallel.records)
        warm = len(parts) - len(answered)
        if any(parts[r] != 1 for r in answered) or warm != 100 or any(n != 1 for n in parts.values()):
            raise RuntimeError("record counts do not match the answered requests")
        print(
            f"{proxies} proxies: {len(answered) + warm} answered, {len(parts)} records, one each; chain intact",
            file=sys.stderr,
        )
        return serial, parallel
    finally:
        await drop(db)


def row(name: str, serial: Run, parallel: Run, direct: Run) -> str:
    added = (statistics.median(serial.latencies) - statistics.median(direct.latencies)) * 1000
    assert serial.commits is not None and parallel.commits is not None
    serial_commit = (
        serial.commits["stackpin_audit_commit_seconds_sum"]
        / serial.commits["stackpin_audit_commit_seconds_count"]
    )
    commits = parallel.commits["stackpin_audit_commit_seconds_count"]
    return (
        f"| {name} | {parallel.throughput:.0f} | {parallel.percentile(0.5) * 1000:.1f} | "
        f"{parallel.percentile(0.99) * 1000:.1f} | {statistics.median(serial.latencies) * 1000:.2f} | {added:.2f} | "
        f"{serial_commit * 1000:.1f} | {parallel.commits['stackpin_audit_batch_size_sum'] / commits:.1f} |"
    )


async def main(args: argparse.Namespace) -> None:
    load_at_start = os.getloadavg()[0]
    replicas, replica_processes = await start_replicas(2)
    try:
        await load(replicas, 100, args.concurrency, "warm-up")
        direct = await load(replicas, args.serial, 1, "direct")
        direct_parallel = await load(replicas, args.requests, args.concurrency, "direct")
        with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as two_dir:
            one = await measure(1, replicas, Path(one_dir), args)
            two = await measure(2, replicas, Path(two_dir), args)
    finally:
        for process in replica_processes:
            process.terminate()
            await process.wait()
    print(
        f"requests {args.requests} at concurrency {args.concurrency}; {args.serial} one at a time; "
        f"cpus {os.cpu_count()}; load average at start {load_at_start:.2f}, at end {os.getloadavg()[0]:.2f}"
    )
    print(
        "| setup | req/s | p50 ms | p99 ms | serial p50 ms | added serial p50 ms | serial commit ms | "
        "entries per commit |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| replicas directly | {direct_parallel.throughput:.0f} | {direct_parallel.percentile(0.5) * 1000:.1f} | "
        f"{direct_parallel.percentile(0.99) * 1000:.1f} | {statistics.median(direct.latencies) * 1000:.2f} | 0 | - | - |"
    )
    print(row("one proxy", *one, direct))
    print(row("two proxies", *two, direct))
    print(f"two proxies / one proxy throughput: {two[1].throughput / one[1].throughput:.2f}x")


def serve_replica(port: int) -> None:
    from aiohttp import web

    from tests.fake_replica import FakeReplica

    async def run() -> None:
        fake = FakeReplica()
        app = web.Application()
        app.add_routes(
            [
                web.get("/v1/stack", fake._stack),
                web.post("/v1/chat/completions", fake._complete),
                web.post("/v1/completions", fake._complete),
            ]
        )
        fake.requests = _Discard()  # type: ignore[assignment]
        fake.headers_seen = _Discard()  # type: ignore[assignment]
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(run())


class _Discard(list):  # type: ignore[type-arg]
    """The fake replica remembers every request for tests; a benchmark has no use for that memory."""

    def append(self, _item: object) -> None:
        return None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--serial", type=int, default=150)
    parser.add_argument("--serve-replica", type=int, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve_replica:
        serve_replica(arguments.serve_replica)
    else:
        asyncio.run(main(arguments))
