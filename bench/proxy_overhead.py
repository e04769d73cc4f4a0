"""What the proxy costs: N requests straight to a trivial replica and N through the proxy, in one run.

    python -m bench.proxy_overhead [--requests 4000] [--concurrency 64] [--store sqlite|postgres]

Latency is measured with one client at a time (so that queueing does not hide the overhead): the added p50 and
p99 are proxy minus direct. Throughput is measured with `--concurrency` clients. The proxy runs as its own process
(`stackpin serve`) with durable audit logging on: SQLite in WAL mode with synchronous=FULL, or PostgreSQL, with
group commit. Every answered request through the proxy is checked to have exactly one record afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp

from bench.services import (
    POSTGRES_URL,
    free_port,
    log_key_environment,
    postgres_schema,
    trivial_replicas,
    wait_until_up,
)
from proxy.audit import AuditStore

WARMUP = 50
BODY = {
    "model": "trivial",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
}


async def sequential(url: str, n: int) -> list[float]:
    latencies = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            started = time.perf_counter()
            async with session.post(url, json=BODY) as response:
                await response.read()
                assert response.status == 200, response.status
            latencies.append(time.perf_counter() - started)
    return latencies


async def concurrent(url: str, n: int, concurrency: int) -> tuple[float, list[str]]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)
    record_ids: list[str] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            queue.get_nowait()
            async with session.post(url, json=BODY) as response:
                await response.read()
                assert response.status == 200, response.status
                if "Stackpin-Record" in response.headers:
                    record_ids.append(response.headers["Stackpin-Record"])

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return n / elapsed, record_ids


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


async def count_records(store_url: str, schema: str | None) -> tuple[int, bool]:
    store = await AuditStore.open(store_url, schema=schema)
    try:
        report = await store.verify()
        return report.entries_checked, report.ok
    finally:
        await store.close()


async def run(args: argparse.Namespace) -> dict[str, object]:
    async with AsyncExitStack() as stack:
        schema = None
        if args.store == "postgres":
            store_url = POSTGRES_URL
            schema = await stack.enter_async_context(postgres_schema("bench_overhead"))
        else:
            store_url = f"sqlite+aiosqlite:///{Path(tempfile.mkdtemp(prefix='stackpin-bench-')) / 'audit.db'}"
        [replica_url] = await stack.enter_async_context(trivial_replicas(1))
        measured = await measure(args, replica_url, store_url, schema)
        entries, chain_ok = await count_records(store_url, schema)
    return {**measured, "records": entries, "chain_ok": chain_ok}


async def measure(
    args: argparse.Namespace, replica_url: str, store_url: str, schema: str | None
) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="stackpin-bench-"))
    proxy_port = free_port()
    config = folder / "stackpin.toml"
    config.write_text(
        f'[server]\nport = {proxy_port}\n[store]\nurl = "{store_url}"\n'
        + f'durability = "{args.durability}"\n'
        + (f'postgres_schema = "{schema}"\n' if schema else "")
        + f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "trivial"\nurl = "{replica_url}"\n'
    )
    env = {**os.environ, **log_key_environment(), "STACKPIN_LOG_LEVEL": "warning"}
    subprocess.run(
        [sys.executable, "-m", "proxy.cli", "db", "upgrade", "--config", str(config)],
        check=True,
        env=env,
        capture_output=True,
    )
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        await wait_until_up(f"http://127.0.0.1:{proxy_port}/readyz")
        direct_url = f"{replica_url}/v1/chat/completions"
        proxy_url = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
        # Warm both paths (connections, caches) before measuring.
        await sequential(direct_url, WARMUP)
        await sequential(proxy_url, WARMUP)
        direct_lat = await sequential(direct_url, args.latency_requests)
        proxy_lat = await sequential(proxy_url, args.latency_requests)
        direct_tput, _ = await concurrent(direct_url, args.requests, args.concurrency)
        proxy_tput, record_ids = await concurrent(proxy_url, args.requests, args.concurrency)
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
    expected = WARMUP + args.latency_requests + args.requests
    ms = 1000.0
    return {
        "store": args.store,
        "durability": args.durability,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "latency_requests": args.latency_requests,
        "direct_p50_ms": percentile(direct_lat, 50) * ms,
        "proxy_p50_ms": percentile(proxy_lat, 50) * ms,
        "added_p50_ms": (percentile(proxy_lat, 50) - percentile(direct_lat, 50)) * ms,
        "direct_p99_ms": percentile(direct_lat, 99) * ms,
        "proxy_p99_ms": percentile(proxy_lat, 99) * ms,
        "added_p99_ms": (percentile(proxy_lat, 99) - percentile(direct_lat, 99)) * ms,
        "direct_rps": direct_tput,
        "proxy_rps": proxy_tput,
        "throughput_ratio": proxy_tput / direct_tput,
        "records_expected": expected,
        "unique_record_ids": len(set(record_ids)) == len(record_ids) == args.requests,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--latency-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--store", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument(
        "--durability", choices=["disk", "process"], default="disk", help="store.durability (see README)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"store {result['store']}, durability {result['durability']}, group commit; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':28}{'direct':>10}{'proxy':>10}{'added':>10}")
    for label, key in (("latency p50 (ms, 1 client)", "p50_ms"), ("latency p99 (ms, 1 client)", "p99_ms")):
        print(
            f"{label:28}{result['direct_' + key]:>10.3f}{result['proxy_' + key]:>10.3f}{result['added_' + key]:>10.3f}"
        )
    print(
        f"{'throughput (req/s, c=' + str(args.concurrency) + ')':28}{result['direct_rps']:>10.0f}"
        f"{result['proxy_rps']:>10.0f}{'  ratio ' + format(result['throughput_ratio'], '.2f'):>10}"
    )
    print(
        f"records: {result['records']} of {result['records_expected']} expected; chain ok: {result['chain_ok']}"
    )


if __name__ == "__main__":
    main()
