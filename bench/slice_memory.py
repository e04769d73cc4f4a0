"""Whether replaying a slice holds a bounded amount of memory: `stackpin replay --since ...` over the newest 1,000
and over 10,000 records of one log, each run in a fresh process that measures its own peak.

A `stackpin serve` on SQLite in front of a trivial replica (bench/trivial_replica.py) is given `--records` chat
requests; then the command replays the newest N of them through it (`--limit N`, on their own stack, no rate
bound), in a child process that traces its allocations (tracemalloc's peak: what Python held at most) and reports
its peak resident size (ru_maxrss: what the process held at most, the interpreter and its imports included). A
slice that streams holds about as much at 10,000 records as at 1,000; one that gathered its records would hold ten
times as much.

Usage, from the repository root:
    python -m bench.slice_memory [--records 10000] [--slices 1000,10000]
Writes bench/results/slice_memory.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp

from bench.proxy_overhead import commit, environment, machine, process, python
from bench.services import free_port, trivial_replicas

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "slice_memory.md"


async def fill(url: str, records: int, concurrency: int = 32) -> None:
    """`records` answered requests through the proxy, each a record."""
    left = iter(range(records))
    connector = aiohttp.TCPConnector(limit=concurrency + 1)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for k in left:
                body = {"model": "trivial", "messages": [{"role": "user", "content": f"request {k}"}]}
                async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"request {k}: HTTP {response.status}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def child(args: argparse.Namespace) -> int:
    """The measured process: the command under tracemalloc; one JSON line with its peaks."""
    from proxy.commands.cli import main as stackpin

    tracemalloc.start()
    started = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = stackpin(["replay", "--since", args.since, "--limit", str(args.limit), "--rate", "0",
                         "--concurrency", "8", "--json", "--url", args.url, "--config", args.config])  # fmt: skip
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    report = json.loads(out.getvalue())
    print(json.dumps({"exit": code, "replayed": report["replayed"], "identical": report["counts"]["identical"],
                      "seconds": seconds, "traced_peak_bytes": peak,
                      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))  # fmt: skip
    return 0


async def measure(args: argparse.Namespace, folder: Path) -> tuple[list[dict[str, Any]], float]:
    env = environment()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = folder / "stackpin.toml"
    async with trivial_replicas(1) as (upstream,):
        config.write_text(
            f'[server]\nport = {port}\n[store]\nurl = "sqlite+aiosqlite:///{folder / "audit.db"}"\n'
            f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "trivial"\nurl = "{upstream}"\n'
        )
        since = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
        async with process(python("-m", "proxy.commands.cli", "serve", "--config", str(config)), f"{url}/readyz",
                           {**env, "STACKPIN_LOG_LEVEL": "warning"}):  # fmt: skip
            started = time.perf_counter()
            await fill(url, args.records)
            fill_s = time.perf_counter() - started
            print(f"filled {args.records} records in {fill_s:.1f} s", file=sys.stderr)
            runs = []
            for limit in args.slices:
                command = python("-m", "bench.slice_memory", "--child", "--limit", str(limit), "--since", since,
                                 "--url", url, "--config", str(config))  # fmt: skip
                done = await asyncio.to_thread(
                    subprocess.run, command, env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    raise RuntimeError(f"the slice of {limit} failed: {done.stderr[-2000:]}")
                runs.append({"limit": limit, **json.loads(done.stdout.strip().splitlines()[-1])})
                print(f"slice of {limit}: {runs[-1]}", file=sys.stderr)
    return runs, fill_s


def report(runs: list[dict[str, Any]], argv: list[str]) -> str:
    host = machine()
    first, last = runs[0], runs[-1]
    traced = last["traced_peak_bytes"] / first["traced_peak_bytes"]
    rss = last["maxrss_kib"] / first["maxrss_kib"]
    lines = [
        "# Replaying a slice: memory against its length",
        "",
        f"Command: `{' '.join(['python -m bench.slice_memory', *argv])}`  ",
        f"Commit: {commit()}; date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {host['cpu']}, {host['cores']} cores, Python {host['python']}, {host['system']}",
        "",
        "`stackpin replay --since T --limit N --rate 0 --concurrency 8 --json` through one `stackpin serve` (SQLite, "
        "a trivial replica), each slice in a fresh process that traces its allocations.",
        "",
        "| records replayed | identical | seconds | tracemalloc peak | peak RSS |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['replayed']:,} | {r['identical']:,} | {r['seconds']:.1f} | {r['traced_peak_bytes'] / 2**20:.1f} MiB "
            f"| {r['maxrss_kib'] / 1024:.1f} MiB |"
            for r in runs
        ),
        "",
        f"{last['replayed']:,} records against {first['replayed']:,}: tracemalloc peak {traced:.2f}x, peak RSS "
        f"{rss:.2f}x. Bounded: the slice is walked a page (200 records) at a time and only counts and 20 examples "
        "are kept.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--slices", default="1000,10000", help="slice lengths, comma-separated")
    parser.add_argument("--no-write", action="store_true", help="print the result; leave results/ alone")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--since", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    args.slices = [int(n) for n in args.slices.split(",")]
    with tempfile.TemporaryDirectory(prefix="stackpin-slice-bench-") as folder:
        runs, _ = asyncio.run(measure(args, Path(folder)))
    text = report(runs, sys.argv[1:] if argv is None else argv)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
