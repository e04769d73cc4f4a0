"""Fairness: another client's latency while long, fast streams run, straight to the replica and through the proxy.

    python -m bench.fairness [--events 80000] [--streams 4] [--rounds 3] [--baseline DIR]

The replica (`bench/trivial_replica.py --stream-events N`) streams N events per answer as fast as the socket takes
them. Each round, for each target in turn (the replica straight, this tree's `stackpin serve`, and with
`--baseline` the `stackpin serve` of another source tree, e.g. `git archive` of an earlier commit): a client sends
a plain chat completion every 20 ms for 2 s on its own (unloaded), then again while `--streams` streams of the same
target are drained by another process (loaded); each request is timed from when it was due, as a client would see
it. Printed: per target, the medians over rounds of the unloaded and loaded p50, the loaded p99, and the rate at
which the streams' events were relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.services import free_port, trivial_replicas, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
PLAIN = {"model": "trivial", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**PLAIN, "stream": True}
INTERVAL_S = 0.02


@dataclass
class Round:
    unloaded_p50: float
    loaded_p50: float
    loaded_p99: float
    events_per_s: float
    failed: (
        int  # requests not answered 200 (a proxy that stalls long enough takes its replica out of rotation)
    )


async def probes(base: str, until: Callable[[], bool]) -> list[tuple[float, int]]:
    """(milliseconds, status) of each plain completion sent every INTERVAL_S until `until()`, timed from when it
    was due."""
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, due: float) -> tuple[float, int]:
        async with session.post(f"{base}/v1/chat/completions", json=PLAIN) as response:
            await response.read()
        return (loop.time() - due) * 1000, response.status

    async with aiohttp.ClientSession() as session:
        started, sent = loop.time(), []
        while not until():
            due = started + len(sent) * INTERVAL_S
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent.append(asyncio.create_task(one(session, due)))
        return list(await asyncio.gather(*sent))


async def drain(base: str, streams: int) -> None:
    """`--drain`: read `streams` streams to their end, in a process of its own."""

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{base}/v1/chat/completions", json=STREAM) as response:
            assert response.status == 200, response.status
            async for _ in response.content.iter_any():
                pass

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(streams)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(base: str, events: int, streams: int) -> Round:
    loop = asyncio.get_running_loop()
    quiet_until = loop.time() + 2.0
    unloaded = [ms for ms, _ in await probes(base, lambda: loop.time() > quiet_until)]
    started = time.perf_counter()
    drainer = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.fairness", "--drain", base, "--streams", str(streams), cwd=ROOT
    )
    waiting = asyncio.create_task(drainer.wait())
    answered = await probes(base, waiting.done)
    assert await waiting == 0, "the streams failed"
    seconds = time.perf_counter() - started
    loaded = [ms for ms, _ in answered]
    return Round(
        statistics.median(unloaded),
        statistics.median(loaded),
        percentile(loaded, 0.99),
        events * streams / seconds,
        sum(1 for _, status in answered if status != 200),
    )


def serve(source: Path, config: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.commands.cli", "serve", "--config", str(config)],
        cwd=config.parent,
        env={**os.environ, "PYTHONPATH": str(source), "STACKPIN_SERVER__PORT": str(port)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def run(args: argparse.Namespace) -> dict[str, list[Round]]:
    sources = {"proxy": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    async with trivial_replicas(1, stream_events=args.events) as [replica]:
        targets, processes = {"straight": replica}, []
        with tempfile.TemporaryDirectory() as folder:
            try:
                for name, source in sources.items():
                    config = Path(folder) / name / "stackpin.toml"
                    config.parent.mkdir()
                    config.write_text(
                        f'log_level = "warning"\n[store]\nurl = "sqlite+aiosqlite:///{config.parent / "audit.db"}"\n'
                        f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "trivial"\nurl = "{replica}"\n'
                    )
                    port = free_port()
                    processes.append(serve(source, config, port))
                    targets[name] = f"http://127.0.0.1:{port}"
                    await wait_until_up(f"{targets[name]}/readyz")
                results: dict[str, list[Round]] = {name: [] for name in targets}
                for _ in range(args.rounds):
                    for name, base in targets.items():  # interleaved: every round measures every target once
                        results[name].append(await measure(base, args.events, args.streams))
                return results
            finally:
                for process in processes:
                    process.terminate()
                    process.wait(timeout=60)


def report(args: argparse.Namespace, results: dict[str, list[Round]]) -> None:
    print(
        f"{args.streams} streams of {args.events} events; a request every {INTERVAL_S * 1000:.0f} ms; {args.rounds} rounds"
    )
    print("| target | unloaded p50 ms | loaded p50 ms | loaded p99 ms | events/s relayed | failed requests |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, rounds in results.items():

        def median(field: str, rounds: list[Round] = rounds) -> float:
            return statistics.median(getattr(r, field) for r in rounds)

        print(
            f"| {name} | {median('unloaded_p50'):.1f} | {median('loaded_p50'):.1f} | {median('loaded_p99'):.1f} "
            f"| {median('events_per_s'):.0f} | {sum(r.failed for r in rounds)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=80_000, help="events per stream (default 80000)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent long streams (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--baseline", help="another source tree whose proxy to measure beside this one's")
    parser.add_argument("--drain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drain:
        asyncio.run(drain(args.drain, args.streams))
    else:
        report(args, asyncio.run(run(args)))


if __name__ == "__main__":
    main()
