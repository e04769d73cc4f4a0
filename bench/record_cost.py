"""What one audit entry costs the event loop to build, canonicalise and hash, in this tree and in another.

    python -m bench.record_cost --baseline DIR [--rounds 7] [--entries 300] [--output bench/results/record_cost.md]

Per entry, as the request path and the committer do it: the entry is built from a served request
(`proxy.serving.records`), which canonicalises it (RFC 8785), then, in a tree whose store signs receipts, the log's
receipt for it is signed as `AuditStore.append` signs it (`proxy.audit.receipts`: one Ed25519 signature), then its
bytes are hashed as the committer reads them (`sha256`, the leaf hash, the row `proxy.audit.batch.entry_row`
makes). Two entries: a small chat answer, and the
`closed` entry of a 64-token stream with logprobs (five alternatives per token), its events and the answer they
assemble into. `DIR` is another source tree (e.g. `git worktree add /tmp/base main`), whose `proxy` package is
imported in a process of its own; rounds alternate which tree goes first. Printed: per entry and tree, the median
over rounds of the median microseconds per entry, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CASES = ("small_answer", "stream_closed_logprobs")
STACK = {
    "schema": 1,
    "model": "bench-model",
    "weights_sha256": "ab" * 32,
    "quantisation": "bf16",
    "hardware": "cpu-x86_64-avx512",
    "hardware_detail": {"cores": 2, "flags": ["avx512f", "avx512bw"]},
    "kernel_mode": "batch_invariant",
    "software": {"backend": "0.1.0", "torch": "2.13.0", "cuda": None, "triton": None, "driver": None},
    "batching": {"max_batch_size": 8, "chunked_prefill": 256},
}
REQUEST = {
    "model": "bench-model",
    "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2 + 2?"}],
    "temperature": 0.0,
    "max_tokens": 64,
    "logprobs": True,
    "top_logprobs": 5,
}


def _token(rng: random.Random, i: int) -> dict[str, Any]:
    # Logprobs as replicas write them: mostly small negatives, some exactly 0.0 and some within 1e-5 of it.
    def logprob() -> float:
        roll = rng.random()
        return 0.0 if roll < 0.1 else -rng.random() * 1e-5 if roll < 0.2 else -rng.random() * 8

    top = [{"token": f"t{i}_{j}", "logprob": logprob(), "bytes": [116, 48 + j]} for j in range(5)]
    return {"token": f" w{i}", "logprob": logprob(), "bytes": [32, 119, 48 + i % 10], "top_logprobs": top}


def _answer(tokens: list[dict[str, Any]] | None, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": "length" if tokens else "stop",
    }
    if tokens is not None:
        choice["logprobs"] = {"content": tokens}
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1764547200,
        "model": "bench-model",
        "system_fingerprint": "cd" * 32,
        "choices": [choice],
        "usage": {"prompt_tokens": 21, "completion_tokens": len(tokens or [1]), "total_tokens": 85},
    }


def _events(tokens: list[dict[str, Any]]) -> list[str]:
    events = []
    for token in tokens:
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"content": token["token"]}, "logprobs": {"content": [token]}}],
        }
        events.append(f"data: {json.dumps(chunk)}\n\n")
    return events


def measure(case: str, entries: int) -> list[float]:
    """`--worker`: microseconds per entry, `entries` times, with the `proxy` package found on sys.path."""
    from proxy.audit.batch import entry_row
    from proxy.pins import Pin
    from proxy.replicas.kinds import STACKPIN
    from proxy.replicas.registry import Replica
    from proxy.serving.prompts import PromptVersion
    from proxy.serving.records import Served, answer_entry, closed_entry
    from proxy.stack import Stack

    try:
        from proxy.audit.note import generate_signer
        from proxy.audit.receipts import ReceiptSigner

        receipts: Any = ReceiptSigner(generate_signer("bench.example/log", seed=bytes(32)))
    except ImportError:  # a tree from before receipts
        receipts = None
    stack = Stack.model_validate(STACK)
    replica = Replica("replica-0", "http://127.0.0.1:1", STACKPIN, stack=stack, fingerprint=stack.fingerprint)
    prompt = PromptVersion("support", 3, "Be terse.")
    rng = random.Random(7)
    tokens = [_token(rng, i) for i in range(64)]
    events, answer = _events(tokens), _answer(tokens, "".join(t["token"] for t in tokens))
    small = _answer(None, "4")
    times = []
    for i in range(entries):
        now = datetime.now(UTC)
        served = Served(f"rec_{i:032x}", "acme", "/v1/chat/completions", Pin(stack=replica.fingerprint),
                        None, prompt, replica, dict(REQUEST), now)  # fmt: skip
        started = time.perf_counter()
        if case == "small_answer":
            entry = answer_entry(served, small, now, upstream={"system_fingerprint": "cd" * 32})
        else:
            entry = closed_entry(served, now, status="complete", events=events, terminal="data: [DONE]\n\n",
                                 answer=answer, replica_answer=None, upstream_fingerprint="cd" * 32,
                                 error=None)  # fmt: skip
        receipt = None if receipts is None else receipts.issue(entry)
        # What the committer reads of a sealed entry: its leaf hash (queue row), its row, the stored summary.
        entry.leaf_hash.hex()
        if receipt is None:
            entry_row(entry, i + 1)  # type: ignore[arg-type]  (each tree's own entry type)
        else:
            entry_row(entry, i + 1, receipt)  # type: ignore[call-arg]
        entry.sha256, entry.leaf_hash.hex()
        times.append((time.perf_counter() - started) * 1e6)
    return times


def _run_tree(tree: Path, case: str, entries: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", case, "--entries", str(entries)]
    done = subprocess.run(worker, env=env, cwd=tree, capture_output=True, text=True, check=True)
    times = json.loads(done.stdout)
    return statistics.median(times[len(times) // 10 :])  # the first tenth warms caches and the allocator


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="another source tree, measured beside this one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--entries", type=int, default=300, help="entries per case, tree and round")
    parser.add_argument("--output", type=Path, help="write the results as Markdown here")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.entries)))
        return
    load_at_start = os.getloadavg()[0]
    trees = {"this tree": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    results: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
        for case in CASES:
            for name, tree in order:
                results.setdefault((case, name), []).append(_run_tree(tree, case, args.entries))
    lines = [
        "| entry | "
        + " | ".join(f"{name} ({_commit(tree)}), µs" for name, tree in trees.items())
        + (" | baseline / this tree |" if args.baseline else " |"),
        "| --- |" + " ---: |" * (len(trees) + bool(args.baseline)),
    ]
    for case in CASES:
        cells = [f"{statistics.median(results[(case, name)]):.1f}" for name in trees]
        if args.baseline:
            ratios = [
                b / t for b, t in zip(results[(case, "baseline")], results[(case, "this tree")], strict=True)
            ]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        command = "python -m bench.record_cost " + " ".join(sys.argv[1:])
        load = f"load average {load_at_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
        machine = f"{platform.machine()}, {os.cpu_count()} cores shared with other work, {load}"
        args.output.write_text(
            "# Record cost: building, canonicalising and hashing one audit entry\n\n"
            f"- command: `{command}`\n- commit: {_commit(ROOT)} (baseline {_commit(trees.get('baseline', ROOT))})\n"
            f"- machine: {machine}, Python {platform.python_version()}\n"
            f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}\n\n"
            f"Medians over {args.rounds} interleaved rounds of the median per entry ({args.entries} entries a "
            "round, the first tenth left out); the ratio is the median of the per-round ratios (range in "
            "brackets).\n\n" + table + "\n"
        )


if __name__ == "__main__":
    main()
