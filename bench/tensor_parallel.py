"""What tensor parallelism's fixed-order combine costs, on this CPU: per layer against the library's all-reduce,
and per step against the model computed whole.

Per layer: two gloo processes (and one, for the tree's price without any communication) run SmolLM2-135M's two
row-parallel products, the attention's output projection (3 chunks, one per KV head) and the MLP's down projection
(8 chunks), as `Parallel.row` runs them in the forward pass, on random activations of 1 and 16 rows: the fixed tree
(each chunk's product, the partials gathered, added in chunk order) against one local product and the library's
all-reduce (what `default` kernels run). The two alternate for `--rounds` rounds; each round times `--calls` calls;
the medians per call are printed with their ratio.

Per step: the GGUF SmolLM2 served by the engine as `stackpin-backend serve` assembles it, every configuration at
one torch thread per process: whole in one process, and the tree at 1 and 2 processes, each decoding the same
8 greedy requests at once; then one request alone. The configurations alternate for `--rounds` rounds; completion
tokens per second, medians. Every configuration's answers are compared: the tree's must be the same bits at every
degree.

Usage, from the repository root:
    python -m bench.tensor_parallel [--rounds 5] [--calls 200] [--max-tokens 24] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pinned_backend.engine import TokenOutput
from pinned_backend.kernels import select_kernels
from pinned_backend.parallel.combine import Parallel, Solo
from pinned_backend.parallel.group import connect
from pinned_backend.parallel.shards import plan_shard
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams

ROWS = (1, 16)
STEP_CONFIGS: tuple[tuple[str, int | None], ...] = (
    ("whole", None),
    ("tree, 1 process", 1),
    ("tree, 2 processes", 2),
)
CONCURRENT = 8


def _smollm2() -> Path:
    from proxy.replicas.local_backend import smollm2_gguf

    return smollm2_gguf()


def _layer_times(store: str, rank: int, degree: int, rounds: int, calls: int, out: Any) -> None:
    """One rank's part of the per-layer measure; rank 0 puts {(reduction, which, rows): [seconds per call]}."""
    torch.set_num_threads(1)
    config = _smollm2_config()
    kernels = select_kernels("batch_invariant", torch.device("cpu"))
    group = connect(Path(store), rank, degree, torch.device("cpu")) if degree > 1 else Solo()
    shard = plan_shard(config, degree, rank)
    generator = torch.Generator().manual_seed(rank)
    widths = {"o": len(shard.q_heads) * config.head_dim, "down": len(shard.intermediate)}
    weights = {
        which: torch.randn(config.hidden_size, width, generator=generator) for which, width in widths.items()
    }
    sides = {
        reduction: Parallel(shard, group, reduction, config.hidden_size)
        for reduction in ("tree", "all_reduce")
    }
    parts = {(r, w): side.split_weight(w, weights[w]) for r, side in sides.items() for w in widths}
    times: dict[tuple[str, str, int], list[float]] = {}
    for round_index in range(rounds + 1):  # the first round warms up and is not counted
        order = list(sides) if round_index % 2 else list(reversed(sides))
        for reduction in order:
            for which, width in widths.items():
                for rows in ROWS:
                    x = torch.randn(rows, width, generator=generator)
                    start = time.perf_counter()
                    for _ in range(calls):
                        sides[reduction].row(kernels, which, x, parts[(reduction, which)])  # type: ignore[arg-type]
                    if round_index:
                        times.setdefault((reduction, which, rows), []).append(
                            (time.perf_counter() - start) / calls
                        )
    if rank == 0:
        out.put(times)


def _smollm2_config() -> Any:
    from pinned_backend.gguf_checkpoint import open_gguf

    return open_gguf(_smollm2()).config


def layer_costs(degree: int, rounds: int, calls: int) -> dict[tuple[str, str, int], list[float]]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = str(Path(folder) / "store")
        others = [
            context.Process(target=_layer_times, args=(store, rank, degree, rounds, calls, queue))
            for rank in range(1, degree)
        ]
        for process in others:
            process.start()
        _layer_times(store, 0, degree, rounds, calls, queue)
        times: dict[tuple[str, str, int], list[float]] = queue.get()
        for process in others:
            process.join()
    return times


def _decode(runtime: Runtime, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[str]]]:
    """Serve `prompts` at once, greedy, to `max_tokens`: (completion tokens per second, each answer's bits)."""
    outputs: dict[str, list[TokenOutput]] = {str(i): [] for i in range(len(prompts))}
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        runtime.engine.submit(str(i), prompt, params, outputs[str(i)].append)
    while runtime.engine.has_work():
        runtime.engine.step()
    elapsed = time.perf_counter() - start
    answers = [[f"{o.token_id}:{float.hex(o.logprob)}" for o in outputs[str(i)]] for i in range(len(prompts))]
    return sum(len(a) for a in answers) / elapsed, answers


def step_costs(rounds: int, max_tokens: int) -> tuple[dict[str, dict[int, list[float]]], dict[str, Any]]:
    runtimes = {
        name: load_runtime(
            BackendSettings(
                model=_smollm2(), tensor_parallel=degree, threads=1, kv_cache_mb=64, prefix_cache=False
            )
        )
        for name, degree in STEP_CONFIGS
    }
    try:
        tokenizer = next(iter(runtimes.values())).tokenizer
        texts = [
            f"Write a short story about a {word}."
            for word in ("cat", "dog", "fox", "owl", "bee", "elk", "ant", "yak")
        ]
        prompts = [tokenizer.encode(text) for text in texts]
        speeds: dict[str, dict[int, list[float]]] = {name: {CONCURRENT: [], 1: []} for name in runtimes}
        answers: dict[str, Any] = {}
        for round_index in range(rounds + 1):
            names = list(runtimes) if round_index % 2 else list(reversed(runtimes))
            for name in names:
                for batch in (CONCURRENT, 1):
                    speed, bits = _decode(runtimes[name], prompts[:batch], max_tokens)
                    if round_index:
                        speeds[name][batch].append(speed)
                    answers.setdefault(name, {})[batch] = bits
        return speeds, answers
    finally:
        for runtime in runtimes.values():
            runtime.close()


def report(
    args: argparse.Namespace, layers: dict[int, dict[Any, list[float]]], speeds: Any, answers: Any
) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "# Tensor parallelism: the price of the fixed-order combine",
        "",
        "`bench/tensor_parallel.py`: SmolLM2-135M-Instruct (GGUF, fp32 compute) on this CPU, one torch thread per "
        "process, gloo over loopback. Interleaved rounds, medians.",
        "",
        f"- Command: `python -m bench.tensor_parallel {shlex.join(sys.argv[1:])}`".rstrip(),
        f"- Commit: `{commit}`",
        f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load} at the end; torch {torch.__version__}",
        f"- Date: {datetime.date.today().isoformat()}",
        "",
        "## Per layer: one row-parallel product and its sum across ranks",
        "",
        "| processes | product | rows | fixed tree, µs | local product + all-reduce, µs | tree / all-reduce |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for degree, times in layers.items():
        for which in ("o", "down"):
            for rows in ROWS:
                tree = statistics.median(times[("tree", which, rows)]) * 1e6
                reduce = statistics.median(times[("all_reduce", which, rows)]) * 1e6
                name = "o_proj (3 chunks)" if which == "o" else "down_proj (8 chunks)"
                lines.append(
                    f"| {degree} | {name} | {rows} | {tree:.0f} | {reduce:.0f} | {tree / reduce:.2f} |"
                )
    lines += [
        "",
        "## Per step: decode, completion tokens per second",
        "",
        f"| configuration | {CONCURRENT} requests at once | 1 request | {CONCURRENT} at once against whole | 1 against whole |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    whole = {batch: statistics.median(speeds["whole"][batch]) for batch in (CONCURRENT, 1)}
    for name in speeds:
        medians = {batch: statistics.median(speeds[name][batch]) for batch in (CONCURRENT, 1)}
        lines.append(
            f"| {name} | {medians[CONCURRENT]:.1f} | {medians[1]:.1f} | {medians[CONCURRENT] / whole[CONCURRENT]:.2f} "
            f"| {medians[1] / whole[1]:.2f} |"
        )
    tree_names = [name for name, degree in STEP_CONFIGS if degree is not None]
    same = all(answers[name] == answers[tree_names[0]] for name in tree_names)
    lines += [
        "",
        f"The tree's answers at 1 and 2 processes: {'the same bits' if same else 'DIFFERENT bits'} "
        f"({CONCURRENT} requests at once and 1 alone, {args.max_tokens} tokens each, token ids and logprob bits).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200, help="row-parallel calls timed per round and shape")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("bench/results/tensor_parallel.md"))
    args = parser.parse_args()
    layers = {degree: layer_costs(degree, args.rounds, args.calls) for degree in (1, 2)}
    speeds, answers = step_costs(args.rounds, args.max_tokens)
    text = report(args, layers, speeds, answers)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
