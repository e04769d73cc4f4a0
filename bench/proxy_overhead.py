"""What the proxy costs: straight to a trivial replica, through a bare aiohttp relay, and through stackpin, side by side.

    python -m bench.proxy_overhead [--rounds 4] [--stores sqlite,postgres] [--workers 2] [--profile] [--quick]

Every round starts fresh processes: a trivial replica (bench/trivial_replica.py), a bare relay (bench/bare_relay.py,
the floor: a Python relay that only forwards), and `stackpin serve` with a durable (`disk`) audit store on SQLite
and on PostgreSQL (a schema of its own), each measured in turn, the order rotated from round to round. Each is
measured with a closed-loop client: latency with one client (added = relay minus straight, in the same round),
throughput with `--concurrency` clients, the relay process's CPU time per request at both (from /proc, its
workers included; PostgreSQL's own processes are not counted), and a stream's time to first byte (stackpin's waits
for the `opened` record); stackpin's mean group commit at one client comes from its own /metrics. After each
stackpin round every answered request must have exactly one record and the log must verify. Figures are medians
over rounds; ratios against the bare relay are taken within each round. Writes bench/results/proxy_overhead.md
and .json (`--results` elsewhere); `--profile` adds, from py-spy over the bare relay and stackpin on SQLite at
`--concurrency` clients, the CPU per request of each part (HTTP server, HTTP client, event loop, the relay's own
work by step, other threads).
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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench import overhead_report
from bench.services import (
    POSTGRES_URL,
    free_port,
    log_key_environment,
    postgres_schema,
    trivial_replicas,
    wait_until_up,
)
from proxy.audit import AuditStore
from proxy.audit.listing import RecordFilter

REPO = Path(__file__).resolve().parent.parent
BODY = json.dumps(
    {"model": "trivial", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
).encode()
STREAM_BODY = json.dumps({**json.loads(BODY), "stream": True}).encode()
HEADERS = {"Content-Type": "application/json"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Target:
    """One way to reach the replica: `straight`, `bare` (the bare relay), or `stackpin` on `store`."""

    kind: str
    store: str | None = None
    workers: int = 1

    @property
    def name(self) -> str:
        if self.kind != "stackpin":
            return self.kind
        return f"stackpin-{self.store}" + (f"-w{self.workers}" if self.workers > 1 else "")


@dataclass
class Figures:
    """One target in one round."""

    target: str
    round: int
    p50_ms: float
    p99_ms: float
    rps: float
    cpu_ms_1: float | None
    cpu_ms_many: float | None
    cpu_ms_many_loop: float | None  # of cpu_ms_many, the event loops' threads' share
    ttfb_p50_ms: float
    commit_ms_1: float | None = None  # stackpin's mean group commit at one client, from its own /metrics
    records: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    rounds: int
    warmup: int
    latency_requests: int
    requests: int
    concurrency: int
    stream_requests: int
    targets: list[Target]
    log_level: str = "warning"


# --- load -------------------------------------------------------------------------------------------------------


async def sequential(session: aiohttp.ClientSession, url: str, n: int, ids: list[str]) -> list[float]:
    latencies = []
    for _ in range(n):
        started = time.perf_counter()
        async with session.post(url, data=BODY, headers=HEADERS) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}")
        latencies.append(time.perf_counter() - started)
        ids.append(response.headers.get("Stackpin-Record", ""))
    return latencies


async def closed_loop(
    session: aiohttp.ClientSession, url: str, n: int, clients: int, ids: list[str]
) -> float:
    """`clients` clients each sending its next request as soon as its last is answered; returns requests/s."""
    left = n

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            async with session.post(url, data=BODY, headers=HEADERS) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url} answered {response.status}")
            ids.append(response.headers.get("Stackpin-Record", ""))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return n / (time.perf_counter() - started)


async def first_bytes(session: aiohttp.ClientSession, url: str, n: int, ids: list[str]) -> list[float]:
    """Time to the first byte of a streamed answer's body, one stream at a time; each is read to its end."""
    times = []
    for _ in range(n):
        started = time.perf_counter()
        async with session.post(url, data=STREAM_BODY, headers=HEADERS) as response:
            first = await response.content.readany()
            times.append(time.perf_counter() - started)
            rest = first + await response.read()
            if response.status != 200 or not rest.endswith(b"data: [DONE]\n\n"):
                raise RuntimeError(f"{url} did not stream a whole answer ({response.status})")
        ids.append(response.headers.get("Stackpin-Record", ""))
    return times


def process_cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU time of `pid` and every process under it (a proxy's workers), in seconds: the
    processes' main threads (their event loops), and all their other threads (the audit writer's, drivers')."""
    loop = others = 0.0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return 0.0, 0.0
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
        children = _children(task)
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        if task.name == str(pid):
            loop += seconds
        else:
            others += seconds
        for child in children:
            child_loop, child_others = process_cpu_s(int(child))
            loop, others = loop + child_loop, others + child_others
    return loop, others


def _children(task: Path) -> list[str]:
    try:
        return (task / "children").read_text().split()
    except OSError:
        return []  # a thread that ended, or a kernel without /proc/PID/task/TID/children: no workers counted


def cpu_s(pid: int | None) -> tuple[float, float]:
    return process_cpu_s(pid) if pid else (0.0, 0.0)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def per_request_ms(before: tuple[float, float], after: tuple[float, float], requests: int) -> float:
    return (sum(after) - sum(before)) / requests * 1000.0


async def measure(
    plan: Plan, target: str, round_: int, url: str, pid: int | None
) -> tuple[Figures, list[str]]:
    ids: list[str] = []
    completions, streams = f"{url}/v1/chat/completions", f"{url}/v1/chat/completions"
    ms = 1000.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await sequential(session, completions, plan.warmup, ids)
        # The scrapes stand outside the CPU window: their cost is no request's.
        commits_before = await commit_seconds(session, url)
        before = cpu_s(pid)
        latencies = await sequential(session, completions, plan.latency_requests, ids)
        after_1 = cpu_s(pid)
        commits_after = await commit_seconds(session, url)
        await closed_loop(session, completions, plan.warmup, plan.concurrency, ids)
        before_many = cpu_s(pid)
        rps = await closed_loop(session, completions, plan.requests, plan.concurrency, ids)
        after_many = cpu_s(pid)
        ttfb = await first_bytes(session, streams, plan.stream_requests, ids)
    figures = Figures(
        target=target,
        round=round_,
        p50_ms=percentile(latencies, 50) * ms,
        p99_ms=percentile(latencies, 99) * ms,
        rps=rps,
        cpu_ms_1=per_request_ms(before, after_1, plan.latency_requests) if pid else None,
        cpu_ms_many=per_request_ms(before_many, after_many, plan.requests) if pid else None,
        cpu_ms_many_loop=(after_many[0] - before_many[0]) / plan.requests * ms if pid else None,
        ttfb_p50_ms=percentile(ttfb, 50) * ms,
        commit_ms_1=mean_commit_ms(commits_before, commits_after),
    )
    return figures, ids


async def commit_seconds(session: aiohttp.ClientSession, url: str) -> tuple[float, float] | None:
    """The sum and count of stackpin's `stackpin_audit_commit_seconds` (each group commit timed by its committer,
    from planning the batch to its callers told), or None from a relay that has none."""
    async with session.get(f"{url}/metrics") as response:
        if response.status != 200:
            return None
        text = await response.text()
    for family in text_string_to_metric_families(text):
        if family.name == "stackpin_audit_commit_seconds":
            found = {s.name: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))}
            return found.get(family.name + "_sum", 0.0), found.get(family.name + "_count", 0.0)
    return None


def mean_commit_ms(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1000.0


# --- processes --------------------------------------------------------------------------------------------------


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO)}


@asynccontextmanager
async def process(
    command: list[str], ready_url: str, env: dict[str, str], timeout_s: float = 60
) -> AsyncIterator[int]:
    """A process that answers `ready_url` within `timeout_s` of its start; stopped (SIGTERM, then waited for) at
    the end."""
    # Its output goes to a file, never a pipe: a proxy logging every request would fill a pipe and stall.
    with tempfile.TemporaryFile() as output:
        started = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            try:
                await wait_until_up(ready_url, timeout_s)
            except RuntimeError:
                started.kill()
                started.wait(timeout=30)
                output.seek(0)
                said = output.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{' '.join(command[1:4])} did not start: {said}") from None
            yield started.pid
        finally:
            if started.poll() is None:
                started.terminate()
            try:
                started.wait(timeout=60)
            except subprocess.TimeoutExpired:
                started.kill()
                started.wait()


@asynccontextmanager
async def bare_relay(upstream: str, env: dict[str, str]) -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with process(python("-m", "bench.bare_relay", str(port), upstream), f"{url}/readyz", env) as pid:
        yield url, pid


@dataclass(frozen=True)
class Store:
    url: str
    schema: str | None


@asynccontextmanager
async def fresh_store(kind: str) -> AsyncIterator[Store]:
    if kind == "postgres":
        async with postgres_schema("bench_overhead") as schema:
            yield Store(POSTGRES_URL, schema)
        return
    with tempfile.TemporaryDirectory(prefix="stackpin-bench-") as folder:
        yield Store(f"sqlite+aiosqlite:///{Path(folder) / 'audit.db'}", None)


@asynccontextmanager
async def stackpin(
    target: Target, upstream: str, store: Store, env: dict[str, str], log_level: str
) -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="stackpin-bench-") as folder:
        config = Path(folder) / "stackpin.toml"
        config.write_text(
            f'[server]\nport = {port}\n[store]\nurl = "{store.url}"\ndurability = "disk"\n'
            + (f'postgres_schema = "{store.schema}"\n' if store.schema else "")
            + f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "trivial"\nurl = "{upstream}"\n'
        )
        env = {**env, **log_key_environment(), "STACKPIN_LOG_LEVEL": log_level}
        cli = python("-m", "proxy.commands.cli")
        subprocess.run(
            [*cli, "db", "upgrade", "--config", str(config)], check=True, env=env, capture_output=True
        )
        workers = ["--workers", str(target.workers)] if target.workers > 1 else []
        command = [*cli, "serve", "--config", str(config), *workers]
        async with process(command, f"http://127.0.0.1:{port}/readyz", env) as pid:
            yield f"http://127.0.0.1:{port}", pid


async def check_records(store: Store, ids: list[str], streams: int) -> dict[str, Any]:
    """Every answered request has exactly one record, each stream two entries, and the log verifies."""
    opened = await AuditStore.open(store.url, schema=store.schema)
    try:
        total = (await opened.count_records(RecordFilter())).total
        report = await opened.verify()
    finally:
        await opened.close()
    answered, distinct = len(ids), len(set(ids) - {""})
    entries = report.entries_checked + report.pending
    checks = {
        "answered": answered,
        "records": total,
        "entries": entries,
        "log_ok": report.ok,
        "ok": report.ok and total == answered == distinct and entries == answered + streams,
    }
    if not checks["ok"]:
        raise RuntimeError(f"the records do not match the answers: {checks}, {report.problem}")
    return checks


async def run_target(plan: Plan, target: Target, round_: int, upstream: str, env: dict[str, str]) -> Figures:
    if target.kind == "straight":
        figures, _ = await measure(plan, target.name, round_, upstream, None)
        return figures
    if target.kind == "bare":
        async with bare_relay(upstream, env) as (url, pid):
            figures, _ = await measure(plan, target.name, round_, url, pid)
        return figures
    assert target.store is not None
    async with fresh_store(target.store) as store:
        async with stackpin(target, upstream, store, env, plan.log_level) as (url, pid):
            figures, ids = await measure(plan, target.name, round_, url, pid)
        figures.records = await check_records(store, ids, plan.stream_requests)
    return figures


async def run_rounds(plan: Plan, env: dict[str, str]) -> list[Figures]:
    results = []
    for round_ in range(plan.rounds):
        shift = round_ % len(plan.targets)
        order = plan.targets[shift:] + plan.targets[:shift]
        async with trivial_replicas(1) as [upstream]:
            for target in order:
                figures = await run_target(plan, target, round_, upstream, env)
                print(overhead_report.progress(figures), flush=True)
                results.append(figures)
    return results


# --- profile ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profiled:
    """One relay under py-spy: its raw stacks, and the CPU per request its threads spent meanwhile (from /proc)."""

    relay: str
    raw: str
    requests: int
    loop_ms: float  # the event loop threads'
    other_ms: float  # every other thread's: the audit writer's, the drivers'


async def profile(plan: Plan, env: dict[str, str], seconds: float) -> list[Profiled]:
    """py-spy over the bare relay, then over stackpin on SQLite, each while `plan.concurrency` clients load it."""
    async with trivial_replicas(1) as [upstream]:
        async with bare_relay(upstream, env) as (url, pid):
            bare = await _profiled("bare", url, pid, plan, seconds)
        async with (
            fresh_store("sqlite") as store,
            stackpin(Target("stackpin", "sqlite"), upstream, store, env, plan.log_level) as (url, pid),
        ):
            served = await _profiled("stackpin-sqlite", url, pid, plan, seconds)
    return [bare, served]


async def _profiled(relay: str, url: str, pid: int, plan: Plan, seconds: float) -> Profiled:
    spy = Path(sys.executable).parent / "py-spy"
    out = Path(tempfile.mkdtemp(prefix="stackpin-bench-")) / f"{relay}.txt"
    completions = f"{url}/v1/chat/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await closed_loop(session, completions, plan.warmup * 4, plan.concurrency, [])
        # Without --idle: only samples of a thread at work count, so that a share of them times the thread's CPU
        # per request is the milliseconds that part costs.
        command = [str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "200",
                   "--format", "raw", "--nonblocking", "--threads", "--output", str(out)]  # fmt: skip
        before = cpu_s(pid)
        recorder = await asyncio.create_subprocess_exec(
            *command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        served = await _load_until(recorder, session, completions, plan.concurrency)
        _, err = await recorder.communicate()
        after = cpu_s(pid)
    if recorder.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-1000:]}")
    loop_ms, other_ms = ((a - b) / max(served, 1) * 1000.0 for a, b in zip(after, before, strict=True))
    return Profiled(relay, out.read_text(), served, loop_ms, other_ms)


async def _load_until(
    recorder: asyncio.subprocess.Process, session: aiohttp.ClientSession, url: str, clients: int
) -> int:
    """Loads `url` until `recorder` ends; how many requests were answered."""
    served = 0
    while recorder.returncode is None:
        await closed_loop(session, url, clients * 10, clients, [])
        served += clients * 10
    return served


# --- main -------------------------------------------------------------------------------------------------------


def serve_accepts_workers(env: dict[str, str]) -> bool:
    shown = subprocess.run(
        python("-m", "proxy.commands.cli", "serve", "--help"), env=env, capture_output=True, text=True
    )
    return "--workers" in shown.stdout


def targets(args: argparse.Namespace, env: dict[str, str]) -> tuple[list[Target], list[str]]:
    notes = []
    stores = [s for s in args.stores.split(",") if s]
    chosen = [Target("straight"), Target("bare")] + [Target("stackpin", store) for store in stores]
    if args.workers > 1:
        if serve_accepts_workers(env):
            chosen += [Target("stackpin", store, args.workers) for store in stores]
        else:
            notes.append(f"--workers {args.workers} skipped: this tree's `stackpin serve` has no --workers")
    return chosen, notes


def cpu_times() -> list[int]:
    """The machine's CPU time so far by kind, in ticks (/proc/stat: user, nice, system, idle, iowait, irq,
    softirq, steal, ...)."""
    return [int(ticks) for ticks in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_share(before: list[int], after: list[int]) -> float | None:
    """Of the CPUs' time between the two readings, the share a virtual machine's host gave to others (steal):
    what a load average does not show, and what makes one run's figures differ from another's."""
    spent = [a - b for a, b in zip(after, before, strict=False)]
    total = sum(spent[:8])
    return round(spent[7] / total, 3) if len(spent) > 7 and total > 0 else None


def machine() -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "system": platform.platform(),
    }


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    # Changes to the results themselves (a previous run's, about to be replaced) change nothing measured.
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    return head + (" (with uncommitted changes)" if changed else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds, fresh processes each (4)")
    parser.add_argument("--latency-requests", type=int, default=1000, help="one at a time, per round (1000)")
    parser.add_argument(
        "--requests", type=int, default=3000, help="at --concurrency clients, per round (3000)"
    )
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop clients for throughput (64)")
    parser.add_argument(
        "--stream-requests", type=int, default=200, help="streams for time to first byte (200)"
    )
    parser.add_argument("--warmup", type=int, default=100, help="requests before each phase's figures (100)")
    parser.add_argument(
        "--stores", default="sqlite,postgres", help="stackpin's stores: sqlite, postgres or both"
    )
    parser.add_argument("--workers", type=int, default=1, help="also run stackpin with this many workers")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="stackpin's log level (warning: no line per request, as the bare relay writes none; info, the "
        "default of `stackpin serve`, adds one line per answer)",
    )
    parser.add_argument("--profile", action="store_true", help="py-spy over stackpin on SQLite afterwards")
    parser.add_argument("--profile-seconds", type=float, default=20, help="how long py-spy samples (20)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, few requests")
    parser.add_argument(
        "--results", type=Path, default=REPO / "bench" / "results", help="folder for the results"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.latency_requests, args.requests, args.stream_requests, args.warmup = (
            1,
            200,
            600,
            40,
            20,
        )
        args.profile_seconds = min(args.profile_seconds, 5)
    if args.profile and not (Path(sys.executable).parent / "py-spy").exists():
        parser.error("--profile needs py-spy beside this Python (pip install py-spy)")
    for store in args.stores.split(","):
        if store not in ("sqlite", "postgres"):
            parser.error(f"--stores takes sqlite and postgres, not {store!r}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    env = environment()
    chosen, notes = targets(args, env)
    plan = Plan(args.rounds, args.warmup, args.latency_requests, args.requests, args.concurrency,
                args.stream_requests, chosen, args.log_level)  # fmt: skip
    started, load_before, times_before = time.monotonic(), os.getloadavg(), cpu_times()
    results = asyncio.run(run_rounds(plan, env))
    costs = None
    if args.profile:
        profiled = asyncio.run(profile(plan, env, args.profile_seconds))
        costs = {
            p.relay: overhead_report.request_costs(p.raw, p.loop_ms, p.other_ms, p.requests) for p in profiled
        }
    run = {
        "command": "python -m bench.proxy_overhead " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "steal_share": steal_share(times_before, cpu_times()),
        "seconds": round(time.monotonic() - started),
        "plan": {**asdict(plan), "targets": [t.name for t in plan.targets]},
        "notes": notes,
    }
    summary = overhead_report.summarise(results)
    document = {
        "run": run,
        "summary": summary,
        "rounds": [asdict(f) for f in results],
        "profile": costs,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "proxy_overhead.json").write_text(json.dumps(document, indent=2) + "\n")
    text = overhead_report.markdown(document)
    (args.results / "proxy_overhead.md").write_text(text)
    print()
    print(overhead_report.table(document))


if __name__ == "__main__":
    main()
