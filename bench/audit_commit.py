"""What a durable audit commit costs: CPU and wall time per transaction, alone (one appender, batches of one) and
under group commit (64 appenders, batches of about 64), on SQLite and PostgreSQL at both durabilities.

Each measurement is a fresh process (`--worker`) that migrates a blank database with its own tree's migrations and
opens the store on it (SQLite in WAL mode, a file in a temporary folder; PostgreSQL in a fresh schema, dropped
after), appends `--appends` entries from the given number of concurrent tasks, then integrates them, checks that
the log verifies, and reports: appends per second; per transaction, the process's CPU time (every thread: the
writer's thread and the event loop, not the PostgreSQL server's) and wall time; per append, the CPU and the p50/p99
latency (queue wait included: what a request waits before the proxy may answer); the mean batch; and the
integrator's CPU per entry. Beside each one-appender row, the driver floor: the p50 of one-row transactions
straight on `sqlite3` or asyncpg with the same sync setting, measured in the same round (on a loaded disk, mostly
its fsync). With `--baseline DIR` (another source tree, e.g. `git archive` of an earlier commit unpacked), every
configuration runs in that tree's process and this one's in turn, for `--rounds` interleaved rounds, and the table
gives both medians and the median of the per-round ratios: on a machine that others load, the ratios are the
figure.

`--integrating` integrates during the appends instead, every 0.5 s as the proxy does: its cost then shows in the
appends' CPU and in their p99.

Usage: python -m bench.audit_commit [--appends N] [--concurrency 1,64] [--rounds 3] [--baseline DIR]
                                    [--integrating] [--postgres-url URL | --no-postgres]
                                    [--output bench/results/audit_commit.md]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STACK = {"schema": 1, "model": "bench", "kernel_mode": "batch_invariant", "hardware": "cpu-x86_64-avx512"}
DEFAULT_POSTGRES = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
DURABILITIES = ("disk", "process")
WORKER_TIMEOUT_S = 600  # only a hang reaches it
PROXY_CHECKPOINT_INTERVAL_S = 0.5  # the proxy's default `log.checkpoint_interval_s`


@dataclass
class Observed:
    sizes: list[int] = field(default_factory=list)

    def committed(self, batch_size: int, seconds: float) -> None:
        self.sizes.append(batch_size)

    def queue_depth(self, depth: int) -> None:
        pass


@dataclass(frozen=True)
class Config:
    database: str  # "SQLite" or "PostgreSQL"
    durability: str
    clients: int


@dataclass(frozen=True)
class Measured:
    appends_per_s: float
    cpu_per_txn_ms: float
    wall_per_txn_ms: float
    cpu_per_append_ms: float
    mean_batch: float
    p50_ms: float
    p99_ms: float
    integrate_cpu_per_entry_ms: float


def entry_values(i: int) -> dict[str, Any]:
    """About the size of a short chat record: a request, 32 tokens with their logprobs, timings."""
    return {
        "record_id": f"bench-{i}",
        "part": "answer",
        "tenant": "bench",
        "created_at": datetime.now(UTC),
        "replica": "replica-a",
        "model": "bench",
        "prompt_text": "You are terse.",
        "status": "complete",
        "content": {
            "request": {"messages": [{"role": "user", "content": f"question {i}"}], "temperature": 0},
            "response": {"token_ids": list(range(32)), "token_logprobs": [-0.001 * t for t in range(32)]},
            "timings": {"received": 0.0, "first_byte": 0.012, "done": 0.05},
        },
    }


def entry_steps() -> tuple[Callable[[dict[str, Any]], Any], Callable[[Any], Any]]:
    """How the measured tree makes an entry from its values: what it does before the timed part, and what on the
    request path, which is timed. `seal` is the request path's (the stack canonicalised once, as the proxy's
    registry does); a tree from before `seal` validated a `NewEntry` first and sealed it when appended. A tree that
    keeps payloads apart is given the request and the response as the entry's payload, as the proxy's records are
    (a salted hash in the entry, a row in `payloads` beside it)."""
    import proxy.audit as audit  # the measured tree's, imported in the worker

    if not hasattr(audit, "seal"):
        return (lambda values: audit.NewEntry(**values, stack=STACK)), (lambda entry: entry)
    from proxy.canonical import CanonicalDocument

    stack = CanonicalDocument.of(STACK)
    if "payload" not in inspect.signature(audit.seal).parameters:
        return (lambda values: values), (lambda values: audit.seal(**values, stack=stack))

    def apart(values: dict[str, Any]) -> dict[str, Any]:
        content = dict(values["content"])
        payload = {key: content.pop(key) for key in ("request", "response")}
        return {**values, "content": content, "payload": payload}

    return apart, (lambda values: audit.seal(**values, stack=stack))


async def measure(
    url: str, schema: str | None, durability: str, appends: int, clients: int, integrating: bool
) -> Measured:
    """One configuration, in this process, with the tree on its path."""
    from proxy.audit import AuditStore
    from proxy.audit.note import generate_signer
    from proxy.audit.schema import upgrade_database_async

    observed = Observed()
    await upgrade_database_async(url, schema=schema)  # the blank database, with this tree's migrations
    store = await AuditStore.open(
        url,
        schema=schema,
        observer=observed,
        batch_wait_ms=0.0,  # the proxy's setting: the queue fills while a commit runs
        durability=durability,  # type: ignore[arg-type]
        signer=generate_signer("bench.local/log"),
        # Integrated as in the proxy, or once after the timed part and measured apart.
        checkpoint_interval_s=PROXY_CHECKPOINT_INTERVAL_S if integrating else 3600,
    )
    latencies: list[float] = []
    prepare, made = entry_steps()
    entries = [prepare(entry_values(i)) for i in range(appends)]
    next_index = iter(range(appends))

    async def client() -> None:
        for i in next_index:
            started = time.perf_counter()
            await store.append(made(entries[i]))
            latencies.append(time.perf_counter() - started)

    try:
        await store.append(
            made(prepare(entry_values(-1)))
        )  # stores the stack and prompt outside the timed part
        observed.sizes.clear()
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        integrate_cpu = time.process_time()
        await store.integrate()
        integrate_cpu = time.process_time() - integrate_cpu
        report = await store.verify()
        assert report.ok and report.tree_size == appends + 1, report
    finally:
        await store.close()
    latencies.sort()
    commits = len(observed.sizes)
    return Measured(
        appends_per_s=appends / wall,
        cpu_per_txn_ms=1000 * cpu / commits,
        wall_per_txn_ms=1000 * wall / commits,
        cpu_per_append_ms=1000 * cpu / appends,
        mean_batch=statistics.fmean(observed.sizes),
        p50_ms=1000 * latencies[len(latencies) // 2],
        p99_ms=1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        integrate_cpu_per_entry_ms=1000 * integrate_cpu / (appends + 1),
    )


async def prepared_database(config: Config, folder: Path, postgres_url: str) -> tuple[str, str | None]:
    """A blank database for one run, (url, schema), which the worker migrates with its own tree's migrations: two
    trees may be at different schema revisions."""
    if config.database == "SQLite":
        return f"sqlite+aiosqlite:///{folder / f'audit-{uuid.uuid4().hex[:12]}.db'}", None
    import asyncpg

    schema = f"audit_bench_{uuid.uuid4().hex[:12]}"
    connection = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await connection.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await connection.close()
    return postgres_url, schema


async def drop_schema(postgres_url: str, schema: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(postgres_url.replace("postgresql+asyncpg://", "postgresql://", 1))
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await connection.close()


FLOOR_TRANSACTIONS = 300


async def driver_floor(config: Config, folder: Path, postgres_url: str) -> float:
    """The p50 in ms of one-row transactions straight on the driver, with the store's sync setting: the least an
    append alone can wait, whatever the store does (on a loaded disk, mostly its fsync)."""
    body = "x" * 700  # about an entry's content
    latencies: list[float] = []
    if config.database == "SQLite":
        connection = sqlite3.connect(folder / f"floor-{uuid.uuid4().hex[:12]}.db", isolation_level=None)
        try:
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(f"PRAGMA synchronous={'FULL' if config.durability == 'disk' else 'NORMAL'}")
            connection.execute("CREATE TABLE floor (seq INTEGER PRIMARY KEY, body TEXT)")
            for seq in range(1, FLOOR_TRANSACTIONS + 1):
                started = time.perf_counter()
                connection.execute("BEGIN IMMEDIATE")
                connection.execute("INSERT INTO floor VALUES (?, ?)", (seq, body))
                connection.execute("COMMIT")
                latencies.append(time.perf_counter() - started)
        finally:
            connection.close()
    else:
        import asyncpg

        settings = {"synchronous_commit": "on" if config.durability == "disk" else "off"}
        dsn = postgres_url.replace("postgresql+asyncpg://", "postgresql://", 1)
        pg = await asyncpg.connect(dsn, server_settings=settings)
        table = f"floor_{uuid.uuid4().hex[:12]}"
        try:
            await pg.execute(f"CREATE TABLE {table} (seq BIGINT PRIMARY KEY, body TEXT)")
            for seq in range(1, FLOOR_TRANSACTIONS + 1):
                started = time.perf_counter()
                await pg.execute(f"INSERT INTO {table} VALUES ($1, $2)", seq, body)  # its own transaction
                latencies.append(time.perf_counter() - started)
        finally:
            await pg.execute(f"DROP TABLE IF EXISTS {table}")
            await pg.close()
    return 1000 * statistics.median(latencies)


async def run_in_tree(tree: Path, config: Config, args: argparse.Namespace, folder: Path) -> Measured:
    """One configuration measured in a fresh process whose `proxy` package is `tree`'s."""
    url, schema = await prepared_database(config, folder, args.postgres_url)
    request = {
        "url": url,
        "schema": schema,
        "durability": config.durability,
        "appends": args.appends,
        "clients": config.clients,
        "integrating": args.integrating,
    }
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            json.dumps(request),
            env={**os.environ, "PYTHONPATH": str(tree)},
            cwd=str(tree),
            stdout=subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(process.communicate(), WORKER_TIMEOUT_S)
        if process.returncode != 0:
            raise RuntimeError(f"the worker for {config} in {tree} failed ({process.returncode})")
        return Measured(**json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        if schema is not None:
            await drop_schema(args.postgres_url, schema)


def configs(args: argparse.Namespace) -> list[Config]:
    databases = ["SQLite"] + ([] if args.no_postgres else ["PostgreSQL"])
    return [
        Config(database, durability, int(clients))
        for clients in args.concurrency.split(",")
        for database in databases
        for durability in DURABILITIES
    ]


async def run_all(
    args: argparse.Namespace,
) -> tuple[dict[Config, dict[str, list[Measured]]], dict[Config, list[float]]]:
    trees = {"after": ROOT, **({"before": Path(args.baseline).resolve()} if args.baseline else {})}
    results: dict[Config, dict[str, list[Measured]]] = {}
    floors: dict[Config, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            for config in configs(args):
                if config.clients == 1:
                    floors.setdefault(config, []).append(
                        await driver_floor(config, Path(folder), args.postgres_url)
                    )
                # Alternate which tree goes first, so that neither always runs on a warmer machine.
                order = list(trees.items())
                if round_index % 2:
                    order.reverse()
                for name, tree in order:
                    measured = await run_in_tree(tree, config, args, Path(folder))
                    results.setdefault(config, {}).setdefault(name, []).append(measured)
                    print(f"round {round_index + 1} {config} {name}: {measured}", file=sys.stderr)
    return results, floors


def _commit(tree: Path) -> str:
    """The checkout's commit, `+` marking uncommitted changes; "not a git checkout" otherwise."""
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def _median(runs: list[Measured], name: str) -> float:
    return statistics.median(getattr(run, name) for run in runs)


def _ratio(runs: dict[str, list[Measured]], name: str) -> str:
    """The median over rounds of after / before, each round's pair measured back to back."""
    if "before" not in runs:
        return ""
    pairs = zip(runs["after"], runs["before"], strict=True)
    return f"{statistics.median(getattr(a, name) / getattr(b, name) for a, b in pairs):.2f}x"


def render(
    results: dict[Config, dict[str, list[Measured]]],
    floors: dict[Config, list[float]],
    args: argparse.Namespace,
    command: str,
) -> str:
    compared = args.baseline is not None
    lines = [
        "# Audit store: what a durable commit costs, per transaction and per append",
        "",
        f"Command: `{command}`  ",
        f"Commit: `{_commit(ROOT)}`"
        + (
            f"; before: `{args.baseline}` (`{args.baseline_label or _commit(Path(args.baseline))}`)"
            if compared
            else ""
        )
        + "  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}; measured {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; "
        f"load average when done {os.getloadavg()[0]:.1f}.  ",
        f"{args.rounds} interleaved rounds, a fresh process and database per run, {args.appends} appends each; "
        + (
            "integration runs during the appends, as in the proxy (its CPU is in the appends' figures); "
            if args.integrating
            else "integration runs after the appends, measured apart; "
        )
        + "medians over rounds. CPU is the appending process's (every thread), not the PostgreSQL server's. "
        "Other work on the machine inflates the absolute figures; the ratios, taken within each round, are "
        "what to read.",
        "",
    ]
    columns = [
        ("CPU/txn ms", "cpu_per_txn_ms"),
        ("wall/txn ms", "wall_per_txn_ms"),
        ("CPU/append ms", "cpu_per_append_ms"),
        ("append p50 ms", "p50_ms"),
        ("append p99 ms", "p99_ms"),
        ("appends/s", "appends_per_s"),
        ("integrate CPU/entry ms", "integrate_cpu_per_entry_ms"),
    ]
    header = "| database | durability | clients | mean batch | driver floor p50 ms |"
    rule = "| --- | --- | ---: | ---: | ---: |"
    for title, _ in columns:
        header += f" {title} |" + (" after/before |" if compared else "")
        rule += " ---: |" + (" ---: |" if compared else "")
    lines += [header, rule]
    for config, runs in results.items():
        floor = f"{statistics.median(floors[config]):.3g}" if config in floors else ""
        row = (
            f"| {config.database} | {config.durability} | {config.clients} "
            f"| {_median(runs['after'], 'mean_batch'):.1f} | {floor} |"
        )
        for _, name in columns:
            after = _median(runs["after"], name)
            if compared:
                before = _median(runs["before"], name)
                row += f" {before:,.3g} → {after:,.3g} | {_ratio(runs, name)} |"
            else:
                row += f" {after:,.3g} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def worker(request: dict[str, Any]) -> None:
    measured = asyncio.run(
        measure(
            request["url"],
            request["schema"],
            request["durability"],
            request["appends"],
            request["clients"],
            request["integrating"],
        )
    )
    print(json.dumps(asdict(measured)))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--appends", type=int, default=1500)
    parser.add_argument(
        "--concurrency", default="1,64", help="comma-separated numbers of concurrent appenders"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="another source tree, measured in turn with this one")
    parser.add_argument("--baseline-label", help="what to call the baseline in the results (e.g. its commit)")
    parser.add_argument(
        "--integrating",
        action="store_true",
        help="integrate during the appends as the proxy does (every 0.5 s), not once after them",
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--output", type=Path, default=Path("bench/results/audit_commit.md"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(json.loads(args.worker))
        return
    results, floors = asyncio.run(run_all(args))
    command = "python -m bench.audit_commit " + " ".join(sys.argv[1:])
    text = render(results, floors, args, command.strip())
    print(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)


if __name__ == "__main__":
    main()
