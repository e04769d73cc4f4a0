"""What batch invariance costs on this machine, and what it buys: both kernel modes on one workload, side by side.

For each kernel mode the backend is assembled exactly as `stackpin-backend serve` assembles it (runtime.py) and
its engine is driven directly, so the figures measure the engine and kernels rather than HTTP:

1. Throughput: `--requests` random prompts with random lengths arrive over the first steps of a run (the same
   schedule in both modes); generated tokens per second of wall time, and the ratio between the modes. The
   modes take turns for `--repeats` rounds and each mode's fastest round counts.
2. Reproducibility: `--identical` copies of one greedy request arrive at different steps amid a background of
   other random requests, so each copy shares its steps with a different batch. Counted: how many distinct
   completions (token ids) and how many distinct answers (token ids and logprob bits) the copies produced.
   A batch-invariant server gives 1 and 1.

Usage, from the repository root:
    stackpin-backend make-tiny /tmp/tiny
    python -m bench.backend_invariance --model /tmp/tiny/stackpin-tiny [--requests 48] [--identical 16]
        [--max-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pinned_backend.engine import Engine
from pinned_backend.runtime import BackendSettings, load_runtime
from pinned_backend.sampling import SamplingParams
from pinned_backend.stack import detect_hardware
from tests.support.scripted_arrivals import Arrival, run_schedule

MODES = ("batch_invariant", "default")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    tokens: int
    seconds: float
    distinct_tokens: int
    distinct_bits: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def random_prompt(rng: random.Random, vocab: int, longest: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(4, longest))]


def throughput_schedule(rng: random.Random, vocab: int, requests: int, max_tokens: int) -> list[Arrival]:
    return [
        Arrival(
            rng.randint(0, 16), f"load-{i}", random_prompt(rng, vocab, 96), greedy(rng.randint(8, max_tokens))
        )
        for i in range(requests)
    ]


def identical_schedule(rng: random.Random, vocab: int, copies: int, max_tokens: int) -> list[Arrival]:
    prompt = random_prompt(rng, vocab, 48)
    arrivals = [Arrival(i * 3, f"copy-{i}", prompt, greedy(max_tokens)) for i in range(copies)]
    background = [
        Arrival(
            rng.randint(0, copies * 3),
            f"bg-{i}",
            random_prompt(rng, vocab, 96),
            greedy(rng.randint(4, max_tokens)),
        )
        for i in range(copies * 2)
    ]
    return arrivals + background


def load(mode: str, args: argparse.Namespace) -> Engine:
    settings = BackendSettings(
        model=args.model,
        kernel_mode=mode,  # type: ignore[arg-type]
        dtype=args.dtype,
        kv_cache_mb=args.kv_cache_mb,
        max_batch_size=args.max_batch_size,
        max_step_tokens=args.max_step_tokens,
        max_queue=args.requests + args.identical * 3,
    )
    return load_runtime(settings).engine


def timed(engine: Engine, arrivals: list[Arrival]) -> tuple[int, float]:
    start = time.perf_counter()
    outputs = run_schedule(engine, arrivals)
    return sum(len(o) for o in outputs.values()), time.perf_counter() - start


def measure(args: argparse.Namespace) -> list[ModeResult]:
    engines = {mode: load(mode, args) for mode in MODES}
    vocab = min(engines[MODES[0]].model.config.vocab_size, 4096)  # type: ignore[attr-defined]
    rng = random.Random(args.seed)
    workload = throughput_schedule(rng, vocab, args.requests, args.max_tokens)
    identical = identical_schedule(rng, vocab, args.identical, args.max_tokens)
    for engine in engines.values():
        run_schedule(engine, workload[:4])  # warm-up: first calls allocate and pick code paths
    # Modes alternate and the best of the repeats counts, so that other load on the machine hits both alike.
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for mode, engine in engines.items():
            tokens[mode], seconds = timed(engine, workload)
            times[mode].append(seconds)
    results = []
    for mode, engine in engines.items():
        copies = run_schedule(engine, identical)
        answers = [v for k, v in copies.items() if k.startswith("copy-")]
        distinct_tokens = len({tuple(o.token_id for o in a) for a in answers})
        distinct_bits = len({tuple((o.token_id, float.hex(o.logprob)) for o in a) for a in answers})
        results.append(ModeResult(mode, tokens[mode], min(times[mode]), distinct_tokens, distinct_bits))
    return results


def table(results: list[ModeResult], identical: int) -> str:
    lines = [
        f"| mode | tokens | best seconds | tokens/s | distinct completions of {identical} | distinct logprob bits |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_second:.1f} "
            f"| {r.distinct_tokens} | {r.distinct_bits} |"
        )
    invariant, default = results
    ratio = invariant.tokens_per_second / default.tokens_per_second
    lines.append("")
    lines.append(f"batch_invariant / default throughput: {ratio:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder (e.g. stackpin-tiny)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--identical", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-step-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mb", type=float, default=64)
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode; the fastest counts")
    args = parser.parse_args()
    hardware, detail = detect_hardware(torch.device("cpu"))
    print(f"{hardware} ({detail['cpu_model']}), torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"python {platform.python_version()}, model {args.model.name}, dtype {args.dtype}")
    print(table(measure(args), args.identical))


if __name__ == "__main__":
    main()
