"""The transparency log against the hash chain it replaced, on one PostgreSQL, with 1, 2 and 4 appending processes.

Each appending process stands for a proxy: it opens the audit store as the proxy does (the log's processes with
the signing key, so each also integrates, one at a time by PostgreSQL's advisory lock) and appends from
`--concurrency` concurrent tasks, as many requests waiting for their records. The hash chain is today's code
before the log, taken from git (`--chained-rev`) into a temporary folder and imported from there. Configurations
run in interleaved rounds (every round runs each one once, in turn), each in a fresh schema; the tables report
medians over the rounds and the log's ratio to the chain.

Reported: appends per second over all processes, the p50 and p99 wait of one append (what a request waits for
its record, queue included), one append at a time (the added latency of a request on an idle store), the entries
per commit; then what PostgreSQL spent per entry (its processes' CPU from /proc, WAL bytes), and from those a
model of where one PostgreSQL saturates; then the rates of signing checkpoints, integrating, and serving proofs
over HTTP from a real proxy.

Usage: python -m bench.audit_log [--rounds 3] [--appends 1500] [--concurrency 32] [--postgres-url URL]
                                 [--chained-rev 1c3fac4] [--output bench/results/audit_log.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from bench.services import free_port, log_key_environment, postgres_schema, trivial_replicas, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POSTGRES = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
STACK = {"schema": 1, "model": "bench", "kernel_mode": "batch_invariant", "hardware": "cpu-x86_64-avx512"}
# A fixed key, so that every process of a run signs as one log; never a production key.
SEED = bytes(range(32))


def entry_values(tag: str, i: int, tenant: str = "bench") -> dict[str, Any]:
    """About the size of a short chat record: a request, 32 tokens with their logprobs, timings."""
    return {
        "record_id": f"bench-{tag}-{i}",
        "part": "answer",
        "tenant": tenant,
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
    """How the imported tree makes an entry from its values: what it does before the timed part, and what on the
    request path, which is timed. `seal` is the request path's (the stack canonicalised once, as the proxy's
    registry does); a tree from before `seal` (the chain's) validated a `NewEntry` first and sealed it when
    appended."""
    import proxy.audit as audit

    if not hasattr(audit, "seal"):
        return (lambda values: audit.NewEntry(**values, stack=STACK)), (lambda entry: entry)
    from proxy.canonical import CanonicalDocument

    stack = CanonicalDocument.of(STACK)
    return (lambda values: values), (lambda values: audit.seal(**values, stack=stack))


# One appending process (run as a script, `--appender JSON`), importing whichever `proxy` its PYTHONPATH names.


async def appender(spec: dict[str, Any]) -> dict[str, Any]:
    from proxy.audit import AuditStore

    options: dict[str, Any] = {"schema": spec["schema"], "batch_max": 256}
    if spec["log"]:
        from proxy.audit.note import generate_signer

        options["signer"] = generate_signer("bench.local/log", seed=SEED)
    sizes: list[int] = []

    class Observed:
        def committed(self, batch_size: int, seconds: float) -> None:
            sizes.append(batch_size)

        def queue_depth(self, depth: int) -> None:
            pass

    store = await AuditStore.open(spec["url"], observer=Observed(), **options)
    prepare, made = entry_steps()
    entries = [prepare(entry_values(spec["tag"], i)) for i in range(spec["appends"])]
    latencies: list[float] = []
    work = iter(entries)

    async def client() -> None:
        for item in work:
            started = time.perf_counter()
            await store.append(made(item))
            latencies.append(time.perf_counter() - started)

    try:
        # Stores the stack and prompt outside the timed part.
        await store.append(made(prepare(entry_values(spec["tag"], -1))))
        sizes.clear()
        await asyncio.sleep(max(0.0, spec["start_at"] - time.time()))
        cpu, started = time.process_time(), time.time()
        await asyncio.gather(*(client() for _ in range(spec["concurrency"])))
        ended, cpu = time.time(), time.process_time() - cpu
    finally:
        await store.close()
    return {"started": started, "ended": ended, "latencies": latencies, "batches": sizes, "cpu_s": cpu}


@dataclass(frozen=True)
class Run:
    variant: str
    processes: int
    appends_per_s: float
    p50_ms: float
    p99_ms: float
    per_commit: float
    client_cpu_ms: float  # appending processes' CPU per append
    pg_cpu_ms: float  # PostgreSQL's CPU per append
    wal_bytes: float  # WAL per append


async def _admin(url: str, statement: str, schema: str | None = None) -> Any:
    args = {"server_settings": {"search_path": schema}} if schema else {}
    engine = create_async_engine(url, poolclass=NullPool, connect_args=args)
    try:
        async with engine.begin() as connection:
            result = await connection.execute(text(statement))
            return result.scalar() if result.returns_rows else None
    finally:
        await engine.dispose()


def postgres_cpu_s() -> float:
    """CPU seconds (user + system) of every process named postgres on this machine."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)
            if "postgres" not in fields[0]:
                continue
            parts = fields[1].split()
            total += sum(int(parts[i]) for i in (11, 12, 13, 14))  # with reaped backends (cutime, cstime)
        except (OSError, IndexError, ValueError):
            continue
    return total / tick


def _environment(code: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    # The chain's `proxy` first, and this tree after it for `bench` (never for `proxy`, found first).
    env["PYTHONPATH"] = os.pathsep.join([str(code), str(ROOT)]) if code else str(ROOT)
    return env


async def measure(
    variant: str, code: Path | None, processes: int, args: argparse.Namespace, *, concurrency: int
) -> Run:
    schema = f"audit_bench_{uuid.uuid4().hex[:10]}"
    await _admin(args.postgres_url, f'CREATE SCHEMA "{schema}"')
    try:
        migrate = f"from proxy.audit.schema import upgrade_database; upgrade_database({args.postgres_url!r}, schema={schema!r})"
        subprocess.run([sys.executable, "-c", migrate], env=_environment(code), check=True, cwd=code or ROOT)
        start_at = time.time() + 2.0 + 0.5 * processes
        specs = [
            {
                "url": args.postgres_url,
                "schema": schema,
                "log": variant == "log",
                "tag": f"p{n}",
                "appends": args.appends // processes,
                "concurrency": concurrency,
                "start_at": start_at,
            }
            for n in range(processes)
        ]
        await asyncio.sleep(max(0.0, start_at - time.time() - 0.3))
        wal0 = await _admin(args.postgres_url, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
        cpu0 = postgres_cpu_s()
        running = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).resolve()),
                "--appender",
                json.dumps(spec),
                env=_environment(code),
                cwd=code or ROOT,
                stdout=asyncio.subprocess.PIPE,
            )
            for spec in specs
        ]
        outputs = [json.loads((await p.communicate())[0]) for p in running]
        cpu1 = postgres_cpu_s()
        wal1 = await _admin(args.postgres_url, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    finally:
        await _admin(args.postgres_url, f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    latencies = sorted(x for out in outputs for x in out["latencies"])
    batches = [b for out in outputs for b in out["batches"]]
    total = len(latencies)
    seconds = max(o["ended"] for o in outputs) - min(o["started"] for o in outputs)
    return Run(
        variant=variant,
        processes=processes,
        appends_per_s=total / seconds,
        p50_ms=1000 * latencies[total // 2],
        p99_ms=1000 * latencies[min(total - 1, int(total * 0.99))],
        per_commit=statistics.fmean(batches) if batches else 0.0,
        client_cpu_ms=1000 * sum(o["cpu_s"] for o in outputs) / total,
        pg_cpu_ms=1000 * (cpu1 - cpu0) / total,
        wal_bytes=float(wal1 - wal0) / total,
    )


def chained_code(revision: str, folder: Path) -> Path:
    """Today's hash chain, as of `revision`, unpacked where it can be imported instead of this tree."""
    archive = subprocess.run(
        ["git", "archive", revision, "proxy", "migrations"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


async def signing_and_proof_rates(args: argparse.Namespace) -> dict[str, float]:
    """Ed25519 checkpoint signatures per second, entries integrated per second, and proofs served over HTTP by a
    `stackpin serve` process from a log of `--proof-log` entries on PostgreSQL."""
    from proxy.audit import AuditStore
    from proxy.audit.note import Checkpoint, parse_signer, sign_note
    from proxy.audit.schema import upgrade_database_async

    environment = log_key_environment()
    signer = parse_signer(environment["STACKPIN_BENCH_LOG_KEY"])
    text_ = Checkpoint(signer.name, 123456789, bytes(32)).text
    started, count = time.perf_counter(), 3000
    for _ in range(count):
        sign_note(text_, signer)
    rates = {"signatures_per_s": count / (time.perf_counter() - started)}

    async with trivial_replicas(1) as [replica], postgres_schema("bench_log", args.postgres_url) as schema:
        await upgrade_database_async(args.postgres_url, schema=schema)
        store = await AuditStore.open(
            args.postgres_url, schema=schema, signer=signer, checkpoint_interval_s=3600
        )
        try:
            prepare, made = entry_steps()
            entries = (made(prepare(entry_values("proof", i, tenant="local"))) for i in range(args.proof_log))
            appends = (store.append(entry) for entry in entries)
            ids = [s.record_id for s in await asyncio.gather(*appends)]
            started = time.perf_counter()
            checkpoint = await store.integrate()
            rates["integrated_per_s"] = args.proof_log / (time.perf_counter() - started)
        finally:
            await store.close()
        assert checkpoint is not None
        size, port = checkpoint.tree_size, free_port()
        with tempfile.TemporaryDirectory() as folder:
            config = Path(folder) / "stackpin.toml"
            config.write_text(
                f'log_level = "warning"\n[server]\nport = {port}\n[store]\nurl = "{args.postgres_url}"\n'
                f'postgres_schema = "{schema}"\n[local_backend]\nenabled = "off"\n'
                f'[[replicas]]\nname = "trivial"\nurl = "{replica}"\n'
            )
            proxy = subprocess.Popen(
                [sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(config)],
                env={**os.environ, **environment},
                cwd=ROOT,
            )
            try:
                url = f"http://127.0.0.1:{port}"
                await wait_until_up(f"{url}/readyz")
                for name, paths in (
                    ("record_proofs_per_s", [f"/v1/records/{ids[(i * 7919) % len(ids)]}/proof" for i in range(600)]),
                    ("consistency_proofs_per_s", [f"/v1/log/consistency?from={1 + (i * 7919) % (size - 1)}" for i in range(600)]),
                    ("checkpoints_per_s", ["/v1/log/checkpoint"] * 600),
                ):  # fmt: skip
                    rates[name] = await _serve_rate(url, paths)
            finally:
                proxy.terminate()
                proxy.wait(timeout=30)
    return rates


async def _serve_rate(url: str, paths: list[str], concurrency: int = 8) -> float:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, path: str) -> None:
        async with gate, session.get(url + path) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{path} answered {response.status}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, p) for p in paths[:50]))  # warm up
        started = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in paths))
        return len(paths) / (time.perf_counter() - started)


def _median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def render(
    runs: list[Run], serial: list[Run], rates: dict[str, float], args: argparse.Namespace, load: float
) -> str:
    lines = [
        "# Audit log: the transparency log against the hash chain, on one PostgreSQL",
        "",
        f"Command: `python -m bench.audit_log --rounds {args.rounds} --appends {args.appends} --concurrency "
        f"{args.concurrency} --chained-rev {args.chained_rev}`  ",
        f"Commit: {_commit()}; machine: {platform.machine()}, {os.cpu_count()} cores (PostgreSQL and the appending "
        f"processes share them), Python {platform.python_version()}; measured "
        f"{datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; load average {load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (other work on the machine inflates absolute figures, less the ratios "
        "measured side by side). PostgreSQL with its defaults (fsync at commit); records of about 0.7 kB.",
        "",
        f"Medians over {args.rounds} interleaved rounds; {args.appends} appends per run, shared by the processes, "
        f"each appending from {args.concurrency} concurrent tasks.",
        "",
        "| processes | chain appends/s | log appends/s | log / chain | chain p50 ms | log p50 ms | chain p99 ms "
        "| log p99 ms | entries per commit (chain, log) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for n in sorted({r.processes for r in runs}):
        chain = [r for r in runs if r.processes == n and r.variant == "chain"]
        log_ = [r for r in runs if r.processes == n and r.variant == "log"]
        ratios = statistics.median(
            a.appends_per_s / b.appends_per_s for a, b in zip(log_, chain, strict=True)
        )
        lines.append(
            f"| {n} | {_median(chain, 'appends_per_s'):,.0f} | {_median(log_, 'appends_per_s'):,.0f} | {ratios:.2f}x "
            f"| {_median(chain, 'p50_ms'):.1f} | {_median(log_, 'p50_ms'):.1f} | {_median(chain, 'p99_ms'):.1f} "
            f"| {_median(log_, 'p99_ms'):.1f} | {_median(chain, 'per_commit'):.0f}, {_median(log_, 'per_commit'):.0f} |"
        )
    for variant in ("chain", "log"):
        ones = [r for r in runs if r.variant == variant]
        scale = {
            n: _median([r for r in ones if r.processes == n], "appends_per_s")
            / _median([r for r in ones if r.processes == 1], "appends_per_s")
            for n in (2, 4)
        }
        lines.append(
            f"\n{variant}: 2 processes {scale[2]:.2f}x and 4 processes {scale[4]:.2f}x the throughput of one."
        )
    chain_serial = [r for r in serial if r.variant == "chain"]
    log_serial = [r for r in serial if r.variant == "log"]
    lines += [
        "",
        f"One append at a time, one process (the latency a request adds on an idle store): chain p50 "
        f"{_median(chain_serial, 'p50_ms'):.2f} ms, log p50 {_median(log_serial, 'p50_ms'):.2f} ms.",
        "",
        "## Where one PostgreSQL saturates",
        "",
    ]
    lines += model_lines(runs)
    lines += [
        "",
        "## Signing and serving",
        "",
        f"- Ed25519 checkpoint signatures: {rates['signatures_per_s']:,.0f}/s on one core (a checkpoint is signed at "
        "most twice a second, so signing costs nothing measurable).",
        f"- Integration: {rates['integrated_per_s']:,.0f} entries/s into the tree (leaves, nodes and one checkpoint per "
        f"round of up to 4096), from a queue of {args.proof_log} entries.",
        f"- Served by a proxy over HTTP, 8 at a time, from a log of {args.proof_log} entries on PostgreSQL: "
        f"{rates['record_proofs_per_s']:,.0f} record proofs/s, {rates['consistency_proofs_per_s']:,.0f} consistency "
        f"proofs/s, {rates['checkpoints_per_s']:,.0f} checkpoints/s.",
    ]
    return "\n".join(lines) + "\n"


def model_lines(runs: list[Run]) -> list[str]:
    """The saturation model, with the inputs it was computed from."""
    log_runs = [r for r in runs if r.variant == "log"]
    pg_cpu = _median(log_runs, "pg_cpu_ms") / 1000
    wal = _median(log_runs, "wal_bytes")
    client_cpu = _median(log_runs, "client_cpu_ms") / 1000
    best = max(log_runs, key=lambda r: r.appends_per_s)
    cores = os.cpu_count() or 1
    return [
        f"Measured, per append, over the log's runs (medians): PostgreSQL spent {1000 * pg_cpu:.3f} ms of CPU "
        f"(its processes' user and system time, /proc) and wrote {wal:,.0f} bytes of WAL; the appending process spent "
        f"{1000 * client_cpu:.3f} ms of CPU (building, hashing, sequencing and integrating). The best run reached "
        f"{best.appends_per_s:,.0f} appends/s with {best.processes} processes, {best.per_commit:.0f} entries per commit.",
        "",
        "No lock is shared on the request path, so PostgreSQL saturates on one of its own resources:",
        "",
        f"- CPU: cores / CPU per append = {cores} / {1000 * pg_cpu:.3f} ms = {cores / pg_cpu:,.0f} appends/s with every "
        f"core of this machine its own; each core given to PostgreSQL adds {1 / pg_cpu:,.0f}/s.",
        f"- WAL: a disk that sustains B bytes/s of WAL saturates at B / {wal:,.0f} appends/s "
        f"(100 MB/s: {100e6 / wal:,.0f}/s).",
        "- Commits: group commit puts many entries in one fsync, so the fsync rate bounds commits, not appends; "
        f"at {best.per_commit:.0f} entries per commit a disk of 1,000 fsyncs/s carries {1000 * best.per_commit:,.0f} appends/s.",
        f"- The appending side needs {client_cpu * 1000:.3f} ms of CPU per append: {1 / client_cpu:,.0f} appends/s per "
        "proxy core, before the proxy's HTTP work, which costs far more (bench/results/fleet.md).",
        "",
        f"On this machine's {cores} shared cores the CPU bound comes first; on a dedicated PostgreSQL the smallest of "
        "these bounds is where it saturates. The hash chain also serialised every commit on its head row (one "
        "transaction at a time, fsync included), which the log's sequencing does not.",
    ]


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


async def main(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    runs: list[Run] = []
    serial: list[Run] = []
    with tempfile.TemporaryDirectory() as folder:
        chained = chained_code(args.chained_rev, Path(folder))
        variants = {"chain": chained, "log": None}
        for round_ in range(args.rounds):
            for processes in (1, 2, 4):
                for variant, code in variants.items():
                    run = await measure(variant, code, processes, args, concurrency=args.concurrency)
                    print(f"round {round_ + 1}: {run}", file=sys.stderr)
                    runs.append(run)
            for variant, code in variants.items():
                serial.append(
                    await measure(
                        variant, code, 1, argparse.Namespace(**{**vars(args), "appends": 200}), concurrency=1
                    )
                )
    rates = await signing_and_proof_rates(args)
    text_ = render(runs, serial, rates, args, load)
    print(text_)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text_)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--appends", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument(
        "--chained-rev", default="1c3fac4", help="the commit whose hash chain to compare with"
    )
    parser.add_argument(
        "--proof-log", type=int, default=5000, help="entries in the log that proofs are served from"
    )
    parser.add_argument("--output", type=Path, default=Path("bench/results/audit_log.md"))
    parser.add_argument("--appender", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.appender:
        print(json.dumps(asyncio.run(appender(json.loads(arguments.appender)))))
    else:
        asyncio.run(main(arguments))
