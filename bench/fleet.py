"""Two proxies against one PostgreSQL and one Redis, against one proxy: throughput and added latency.

Everything runs on this machine, over loopback: two trivial replicas (bench/trivial_replica.py, each in its own
process, answering at once, so the proxy's own cost is what is measured), `stackpin serve` processes in fleet mode with
`stackpin fleet heartbeat` sidecars, PostgreSQL as the audit store and Redis as the fleet state. Each setup gets
a fresh PostgreSQL schema and Redis prefix. For each, two runs: one request at a time (latency, compared with
the same requests sent straight to a replica: the difference is what the proxy adds), and `--concurrency`
requests at a time (throughput). Afterwards the records are counted: every answered request must have exactly
one record, and `stackpin verify` must find the log intact; the benchmark fails otherwise.

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
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from bench.services import (
    POSTGRES_URL,
    REDIS_URL,
    free_port,
    log_key_environment,
    postgres_schema,
    redis_prefix,
    trivial_replicas,
    wait_until_up,
)

BODY = {"model": "trivial", "max_tokens": 16, "temperature": 0}


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


@dataclass
class Processes:
    """`stackpin` subcommands running as processes, as a fleet runs them, each logging to a file of its own."""

    folder: Path
    env: dict[str, str]
    running: list[tuple[asyncio.subprocess.Process, Path]] = field(default_factory=list)

    async def start(self, *args: str, log_name: str) -> None:
        log = self.folder / f"{log_name}.log"
        with log.open("wb") as sink:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy.commands.cli", *args, env=self.env, stdout=sink, stderr=sink
            )
        self.running.append((process, log))

    async def run(self, *args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.commands.cli", *args, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await process.communicate()
        return int(process.returncode or 0), out.decode()

    async def stop_all(self) -> None:
        live = [process for process, _ in self.running if process.returncode is None]
        for process in live:
            process.terminate()
        await asyncio.gather(*(process.wait() for process in live))


@asynccontextmanager
async def fleet(
    folder: Path, proxies: int, replicas: Mapping[str, str], schema: str, prefix: str
) -> AsyncIterator[tuple[list[str], Processes]]:
    """`proxies` `stackpin serve` processes in fleet mode and one `stackpin fleet heartbeat` per replica; yields
    the proxies' base URLs once each is ready."""
    env = {
        **os.environ,
        **log_key_environment(),
        "STACKPIN_FLEET__KEY_PREFIX": prefix,
        "STACKPIN_STORE__POSTGRES_SCHEMA": schema,
    }
    processes = Processes(folder, env)
    sidecar = folder / "heartbeat.toml"
    sidecar.write_text('log_level = "warning"\n[local_backend]\nenabled = "off"\n')
    urls = []
    try:
        for name, url in replicas.items():
            await processes.start(
                "fleet", "heartbeat", "--replica-url", url, "--name", name, "--redis", REDIS_URL,
                "--lease-s", "5", "--config", str(sidecar), log_name=f"heartbeat-{name}",
            )  # fmt: skip
        for _ in range(proxies):
            port = free_port()
            config = folder / f"proxy-{port}.toml"
            config.write_text(
                f'log_level = "warning"\n[server]\nport = {port}\n[store]\nurl = "{POSTGRES_URL}"\n'
                f'[local_backend]\nenabled = "off"\n[fleet]\nredis_url = "{REDIS_URL}"\nsync_interval_s = 1.0\n'
            )
            await processes.start("serve", "--config", str(config), log_name=f"proxy-{port}")
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            await wait_until_up(f"{url}/readyz")
        yield urls, processes
    finally:
        await processes.stop_all()


async def measure(
    proxies: int, replicas: list[str], folder: Path, args: argparse.Namespace
) -> tuple[Run, Run]:
    from proxy.audit.schema import upgrade_database_async

    async with postgres_schema("bench_fleet") as schema:
        with redis_prefix() as prefix:
            await upgrade_database_async(POSTGRES_URL, "head", schema=schema)
            named = {f"r{i}": url for i, url in enumerate(replicas)}
            async with fleet(folder, proxies, named, schema, prefix) as (urls, processes):
                await load(urls, 100, args.concurrency, "warm-up")
                serial = await with_commits(urls, args.serial, 1, "serial")
                parallel = await with_commits(urls, args.requests, args.concurrency, "parallel")
                await processes.stop_all()
                config = folder / "verify.toml"
                config.write_text(f'[store]\nurl = "{POSTGRES_URL}"\n[local_backend]\nenabled = "off"\n')
                status, out = await processes.run("verify", "--config", str(config))
                if status != 0:
                    raise RuntimeError(f"stackpin verify failed:\n{out}")
            parts = await record_parts(POSTGRES_URL, schema)
    answered = Counter(serial.records + parallel.records)
    warm = len(parts) - len(answered)
    if any(parts[r] != 1 for r in answered) or warm != 100 or any(n != 1 for n in parts.values()):
        raise RuntimeError("record counts do not match the answered requests")
    print(
        f"{proxies} proxies: {len(answered) + warm} answered, {len(parts)} records, one each; log intact",
        file=sys.stderr,
    )
    return serial, parallel


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
    async with trivial_replicas(2) as replicas:
        await load(replicas, 100, args.concurrency, "warm-up")
        direct = await load(replicas, args.serial, 1, "direct")
        direct_parallel = await load(replicas, args.requests, args.concurrency, "direct")
        with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as two_dir:
            one = await measure(1, replicas, Path(one_dir), args)
            two = await measure(2, replicas, Path(two_dir), args)
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--serial", type=int, default=150)
    asyncio.run(main(parser.parse_args()))
