"""Fairness: another client's latency while long, fast streams run, straight to the upstream and through the proxy.

    python bench/fairness.py [--chunks 80000] [--streams 4] [--rounds 3] [--baseline DIR]

The upstream (`tests/fast_upstream.py`) streams `--chunks` events per answer as fast as a socket takes them. Each
round, for each target in turn (the upstream straight, this tree's `stackpin serve`, and with `--baseline` the
`stackpin serve` of another source tree, e.g. an export of an earlier commit): a client sends a plain chat
completion every 20 ms for 2 s on its own (unloaded), then again while `--streams` streams of the same target are
drained by another process (loaded); each request is timed from when it was due, as a client would see it.
Printed: per target the medians over rounds of the unloaded and loaded p50 and p99, and the streams' relay rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
PLAIN = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
STREAM = {**PLAIN, "stream": True}
INTERVAL_S = 0.02


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_until_up(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


async def probes(base: str, until: Callable[[], bool]) -> list[float]:
    """Milliseconds of each plain completion sent every INTERVAL_S until `until()`, from when it was due."""
    loop = asyncio.get_running_loop()

    async def one(session: aiohttp.ClientSession, due: float) -> float:
        async with session.post(f"{base}/v1/chat/completions", json=PLAIN) as response:
            await response.read()
            assert response.status == 200, response.status
        return (loop.time() - due) * 1000

    async with aiohttp.ClientSession() as session:
        started, sent = loop.time(), []
        while not until():
            due = started + len(sent) * INTERVAL_S
            await asyncio.sleep(max(0.0, due - loop.time()))
            sent.append(asyncio.create_task(one(session, due)))
        return list(await asyncio.gather(*sent))


async def drain(base: str, streams: int) -> None:
    """The `--drain` mode: read `streams` streams to their end, in this process of its own."""

    async def one(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{base}/v1/chat/completions", json=STREAM) as response:
            assert response.status == 200, response.status
            async for _ in response.content.iter_any():
                pass

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(streams)))


@dataclass
class Round:
    unloaded_p50: float
    loaded_p50: float
    loaded_p99: float
    chunks_per_s: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(base: str, chunks: int, streams: int) -> Round:
    loop = asyncio.get_running_loop()
    quiet_until = loop.time() + 2.0
    unloaded = await probes(base, lambda: loop.time() > quiet_until)
    started = time.perf_counter()
    drainer = await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__)), "--drain", base, "--streams", str(streams)
    )
    waiting = asyncio.create_task(drainer.wait())
    loaded = await probes(base, waiting.done)
    assert await waiting == 0, "the streams failed"
    seconds = time.perf_counter() - started
    return Round(
        statistics.median(unloaded),
        statistics.median(loaded),
        percentile(loaded, 0.99),
        chunks * streams / seconds,
    )


def serve(source: Path, config: Path, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(source)}
    return subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--config", str(config)],
        cwd=config.parent,
        env={**env, "STACKPIN_SERVER__PORT": str(port)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def main(args: argparse.Namespace) -> None:
    upstream = subprocess.Popen(
        [sys.executable, "-m", "tests.fast_upstream", "--chunks", str(args.chunks)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert upstream.stdout is not None
    upstream_url = upstream.stdout.readline().decode().strip()
    targets: dict[str, str] = {"straight": upstream_url}
    processes = [upstream]
    sources = {"proxy": ROOT, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    with tempfile.TemporaryDirectory() as folder:
        try:
            for name, source in sources.items():
                config = Path(folder) / name / "stackpin.toml"
                config.parent.mkdir()
                config.write_text(
                    f'log_level = "warning"\n[store]\nurl = "sqlite+aiosqlite:///{config.parent / "audit.db"}"\n'
                    f'[local_backend]\nenabled = "off"\n[[replicas]]\nname = "fast"\nurl = "{upstream_url}"\n'
                )
                port = free_port()
                processes.append(serve(source, config, port))
                targets[name] = f"http://127.0.0.1:{port}"
                await wait_until_up(f"{targets[name]}/readyz")
            results: dict[str, list[Round]] = {name: [] for name in targets}
            for _ in range(args.rounds):
                for name, base in targets.items():  # interleaved: each round measures every target once
                    results[name].append(await measure(base, args.chunks, args.streams))
        finally:
            for process in processes:
                process.terminate()
                process.wait(timeout=30)
    print(
        f"{args.streams} streams of {args.chunks} events, probes every {INTERVAL_S * 1000:.0f} ms, {args.rounds} rounds"
    )
    print("| target | unloaded p50 ms | loaded p50 ms | loaded p99 ms | events/s relayed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rounds in results.items():

        def med(field: str, rounds: list[Round] = rounds) -> float:
            return statistics.median(getattr(r, field) for r in rounds)

        print(
            f"| {name} | {med('unloaded_p50'):.1f} | {med('loaded_p50'):.1f} | {med('loaded_p99'):.1f} "
            f"| {med('chunks_per_s'):.0f} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=80_000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="another source tree whose proxy to measure beside this one's")
    parser.add_argument("--drain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drain:
        asyncio.run(drain(args.drain, args.streams))
    else:
        asyncio.run(main(args))
