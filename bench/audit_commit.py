"""What a durable audit commit costs, and what group commit buys back, measured side by side in one run.

For SQLite (WAL, synchronous=FULL, a file in a temporary folder) and PostgreSQL (a fresh schema, dropped after),
`--appends` entries are appended by each number of concurrent tasks in `--concurrency`, first with
`batch_max=1` (one transaction and one fsync per entry), then with the store's defaults (group commit), then
with `durability="process"` (group commit without the sync at each commit, to show what the sync costs). Printed and written as Markdown:
appends per second, the ratio between the two, the mean and largest group commit, and the p50/p99 latency of
one append (queue wait included), which is what a request waits before the proxy may answer.

Usage: python -m bench.audit_commit [--appends N] [--concurrency 1,64] [--postgres-url URL | --no-postgres]
                                    [--output bench/results/audit_commit.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.services import postgres_schema
from proxy.audit import AuditStore, NewEntry
from proxy.audit.database import Durability
from proxy.audit.note import generate_signer
from proxy.audit.schema import upgrade_database_async

STACK = {"schema": 1, "model": "bench", "kernel_mode": "batch_invariant", "hardware": "cpu-x86_64-avx512"}
DEFAULT_POSTGRES = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
# (batch_max, durability): one commit per entry, group commit, group commit without the sync at each commit.
CONFIGS: list[tuple[int, Durability]] = [(1, "disk"), (256, "disk"), (256, "process")]


@dataclass
class Observed:
    sizes: list[int] = field(default_factory=list)

    def committed(self, batch_size: int, seconds: float) -> None:
        self.sizes.append(batch_size)

    def queue_depth(self, depth: int) -> None:
        pass


@dataclass
class Result:
    database: str
    clients: int
    batch_max: int
    durability: str
    appends_per_s: float
    mean_batch: float
    max_batch: int
    p50_ms: float
    p99_ms: float
    verify_per_s: float


def make_entry(i: int) -> NewEntry:
    """About the size of a short chat record: a request, 32 tokens with their logprobs, timings."""
    return NewEntry(
        record_id=f"bench-{i}",
        part="answer",
        tenant="bench",
        created_at=datetime.now(UTC),
        replica="replica-a",
        model="bench",
        stack=STACK,
        prompt_text="You are terse.",
        status="complete",
        content={
            "request": {"messages": [{"role": "user", "content": f"question {i}"}], "temperature": 0},
            "response": {"token_ids": list(range(32)), "token_logprobs": [-0.001 * t for t in range(32)]},
            "timings": {"received": 0.0, "first_byte": 0.012, "done": 0.05},
        },
    )


async def run_one(
    database: str,
    url: str,
    schema: str | None,
    config: tuple[int, Durability],
    appends: int,
    concurrency: int,
) -> Result:
    observed = Observed()
    batch_max, durability = config
    store = await AuditStore.open(
        url,
        schema=schema,
        batch_max=batch_max,
        observer=observed,
        durability=durability,
        signer=generate_signer("bench.local/log"),
        checkpoint_interval_s=3600,  # integrated once, after the timed part
    )
    latencies: list[float] = []
    entries = [make_entry(i) for i in range(appends)]
    next_index = iter(range(appends))

    async def client() -> None:
        for i in next_index:
            started = time.perf_counter()
            await store.append(entries[i])
            latencies.append(time.perf_counter() - started)

    try:
        await store.append(make_entry(-1))  # stores the stack and prompt outside the timed part
        observed.sizes.clear()
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        await store.integrate()
        verify_started = time.perf_counter()
        report = await store.verify()
        verify_elapsed = time.perf_counter() - verify_started
        assert report.ok and report.tree_size == appends + 1, report
    finally:
        await store.close()
    latencies.sort()
    return Result(
        database=database,
        clients=concurrency,
        batch_max=batch_max,
        durability=durability,
        appends_per_s=appends / elapsed,
        mean_batch=statistics.fmean(observed.sizes),
        max_batch=max(observed.sizes),
        p50_ms=1000 * latencies[len(latencies) // 2],
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        verify_per_s=report.entries_checked / verify_elapsed,
    )


async def bench_sqlite(appends: int, concurrency: int) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for config in CONFIGS:
            url = f"sqlite+aiosqlite:///{Path(folder) / f'audit-{concurrency}-{config[0]}-{config[1]}.db'}"
            await upgrade_database_async(url)
            results.append(await run_one("SQLite", url, None, config, appends, concurrency))
    return results


async def bench_postgres(url: str, appends: int, concurrency: int) -> list[Result]:
    results = []
    for config in CONFIGS:
        async with postgres_schema("audit_bench", url) as schema:
            await upgrade_database_async(url, schema=schema)
            results.append(await run_one("PostgreSQL", url, schema, config, appends, concurrency))
    return results


def _commit() -> str:
    """The checkout's commit, `+` marking uncommitted changes; "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def render(results: list[Result], appends: int, concurrency: str) -> str:
    lines = [
        "# Audit store: cost of a durable commit, with and without group commit",
        "",
        f"Command: `python -m bench.audit_commit --appends {appends} --concurrency {concurrency}`  ",
        f"Commit: `{_commit()}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"measured {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}. "
        "SQLite in WAL mode with synchronous=FULL; PostgreSQL with its defaults (fsync on commit). "
        f"One record ~0.7 kB of content. Load average when done: {os.getloadavg()[0]:.1f} "
        "(other work on the machine inflates the absolute figures, not the ratios between rows).",
        "",
        "| database | clients | batch_max | durability | appends/s | vs batch_max=1 | mean batch | max batch "
        "| append p50 ms | append p99 ms | verify entries/s |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    single = {(r.database, r.clients): r.appends_per_s for r in results if r.batch_max == 1}
    for r in results:
        ratio = r.appends_per_s / single[(r.database, r.clients)]
        lines.append(
            f"| {r.database} | {r.clients} | {r.batch_max} | {r.durability} | {r.appends_per_s:,.0f} | {ratio:.1f}x "
            f"| {r.mean_batch:.1f} | {r.max_batch} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.verify_per_s:,.0f} |"
        )
    return "\n".join(lines) + "\n"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--appends", type=int, default=3000)
    parser.add_argument(
        "--concurrency", default="1,64", help="comma-separated numbers of concurrent appenders"
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("bench/results/audit_commit.md"))
    args = parser.parse_args()
    results: list[Result] = []
    for clients in (int(c) for c in args.concurrency.split(",")):
        results += await bench_sqlite(args.appends, clients)
        if not args.no_postgres:
            results += await bench_postgres(args.postgres_url, args.appends, clients)
    text = render(results, args.appends, args.concurrency)
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)


if __name__ == "__main__":
    asyncio.run(main())
