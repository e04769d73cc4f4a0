"""What a study costs over its requests: the same prompts x repeats through one `stackpin serve` on the embedded
default, sent as `stackpin study` and sent plainly at the same concurrency, in interleaved rounds.

The plain arm is the least a client can do: an aiohttp session posting each request of the study's schedule (the
same bodies in the same round-robin order) with C in flight, reading each answer. The study arm is the command
itself, run in this process (`proxy.commands.cli.main`): reading the prompt set, tagging every request, tallying
every answer, and writing the report as JSON and HTML. Both arms run in a thread of their own with their own event
loop, against one proxy and one backend, taking turns in each round; each round's ratio is study / plain, and the
median over rounds is the figure. The command's own start (importing it, once per invocation) is timed apart.

Usage, from the repository root:
    python -m bench.study_overhead [--prompts 100] [--repeats 10] [--concurrency 8] [--max-tokens 8] [--rounds 3]
Writes bench/results/study_overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.proxy_overhead import commit, environment, machine, process, python
from bench.services import free_port
from proxy.commands.cli import main as stackpin

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "study_overhead.md"
TARGET = 2.0
WORDS = [
    "harbour",
    "lantern",
    "orchard",
    "copper",
    "meadow",
    "violin",
    "compass",
    "island",
    "quartz",
    "ladder",
    "candle",
    "marble",
]


@dataclass(frozen=True)
class Round:
    index: int
    order: str  # which arm went first
    plain_s: float
    study_s: float

    @property
    def ratio(self) -> float:
        return self.study_s / self.plain_s


def prompts(count: int) -> list[str]:
    return [
        f"Question {i}: say something about {WORDS[i % 12]} and {WORDS[(i * 5) % 12]}." for i in range(count)
    ]


def plain(url: str, model: str, texts: list[str], repeats: int, concurrency: int, max_tokens: int) -> float:
    """The study's requests, in its order, sent with nothing else: seconds until the last answer."""

    async def run() -> float:
        schedule = iter([text for _ in range(repeats) for text in texts])
        failed = 0
        connector = aiohttp.TCPConnector(limit=concurrency + 1)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def worker() -> None:
                nonlocal failed
                for text in schedule:
                    body = {"model": model, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "temperature": 0.0}  # fmt: skip
                    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
                        await response.json()
                        failed += response.status != 200

            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            seconds = time.perf_counter() - started
        if failed:
            raise RuntimeError(f"{failed} plain requests failed")
        return seconds

    return asyncio.run(run())


def study(args: list[str]) -> float:
    """`stackpin study ...` in this process: seconds from the call to its return, report written."""
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = stackpin(args)
    seconds = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"stackpin study exited {code}")
    return seconds


def command_start_s() -> float:
    """The median of three `stackpin --help` runs: what starting the command costs before it sends anything."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run(python("-m", "proxy.commands.cli", "--help"), env=environment(), capture_output=True,
                       check=True)  # fmt: skip
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def measure(args: argparse.Namespace, folder: Path) -> tuple[list[Round], dict[str, Any]]:
    env = environment()
    tiny = folder / "models"
    subprocess.run(python("-m", "pinned_backend.cli", "make-tiny", str(tiny)), env=env, check=True,
                   capture_output=True)  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = folder / "stackpin.toml"
    config.write_text(
        f'[server]\nport = {port}\n[store]\nurl = "sqlite+aiosqlite:///{folder / "audit.db"}"\n'
        f'[local_backend]\nenabled = "on"\nmodel = "{tiny / "stackpin-tiny"}"\nkernel_mode = "batch_invariant"\n'
    )
    texts = prompts(args.prompts)
    prompt_file = folder / "prompts.txt"
    prompt_file.write_text("\n".join(texts) + "\n")
    rounds = []
    async with process(
        python("-m", "proxy.commands.cli", "serve", "--config", str(config)), f"{url}/readyz", env
    ):
        plain_args = (url, "stackpin-tiny", texts, args.repeats, args.concurrency, args.max_tokens)
        await asyncio.to_thread(
            plain, *plain_args
        )  # a warm-up: the first requests pay for the backend's start
        for index in range(args.rounds):
            study_args = ["study", str(prompt_file), "--url", url, "--config", str(config), "-n",
                          str(args.repeats), "--load", str(args.concurrency), "--model", "stackpin-tiny",
                          "--max-tokens", str(args.max_tokens), "--out", str(folder / f"study-{index}")]  # fmt: skip
            if index % 2 == 0:
                plain_s = await asyncio.to_thread(plain, *plain_args)
                study_s = await asyncio.to_thread(study, study_args)
            else:
                study_s = await asyncio.to_thread(study, study_args)
                plain_s = await asyncio.to_thread(plain, *plain_args)
            rounds.append(Round(index, "plain first" if index % 2 == 0 else "study first", plain_s, study_s))
            print(f"round {index}: plain {plain_s:.2f} s, study {study_s:.2f} s", file=sys.stderr)
    return rounds, {"command_start_s": command_start_s()}


def report(args: argparse.Namespace, rounds: list[Round], extra: dict[str, Any], argv: list[str]) -> str:
    ratio = statistics.median(r.ratio for r in rounds)
    requests = args.prompts * args.repeats
    host = machine()
    lines = [
        "# A study's cost over its requests",
        "",
        f"Command: `{' '.join(['python -m bench.study_overhead', *argv])}`  ",
        f"Commit: {commit()}; date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {host['cpu']}, {host['cores']} cores, Python {host['python']}, {host['system']}",
        "",
        f"{args.prompts} prompts x {args.repeats} repeats ({requests} requests) at concurrency {args.concurrency}, "
        f"{args.max_tokens} tokens each, through one `stackpin serve` on the embedded default (the tiny model, "
        "batch_invariant, SQLite): `stackpin study` against the same requests sent plainly, in turns.",
        "",
        "| round | order | plain s | study s | study / plain |",
        "| ---: | --- | ---: | ---: | ---: |",
        *(f"| {r.index} | {r.order} | {r.plain_s:.2f} | {r.study_s:.2f} | {r.ratio:.2f}x |" for r in rounds),
        "",
        f"Median study / plain: **{ratio:.2f}x** (target: at most {TARGET:g}x: {'met' if ratio <= TARGET else 'NOT MET'}).",
        f"Starting the command (`stackpin --help`, median of 3) takes {extra['command_start_s']:.2f} s more, once.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print the result; leave results/ alone")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stackpin-study-bench-") as folder:
        rounds, extra = asyncio.run(measure(args, Path(folder)))
    text = report(args, rounds, extra, sys.argv[1:] if argv is None else argv)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
