"""What a grammar costs the batch: completion tokens per second of 8 concurrent `json_schema` requests against 8
unconstrained ones, side by side, on the embedded default model (SmolLM2-135M-Instruct) unless told otherwise.

The backend is assembled as `stackpin-backend serve` assembles it (runtime.py) and its engine is driven directly,
so the figures measure the engine, the masks and the kernels rather than HTTP. Each round serves the same 8 chat
prompts twice, greedy, all 8 submitted at once: once constrained to a JSON schema (an array of people, each with a
name, an age and a city: compiled through the server's own path, response_format's), once free. Both run to
max_tokens, so the two sides decode the same number of tokens in batches of the same size; the finish reasons are
reported to show it. The sides alternate for `--rounds` rounds after one uncounted warm-up each; the medians and
their ratio are printed. Completion tokens per second: the 8 answers' tokens over the wall time from the first
submit to the last token, prefill included. `--profile` adds where the time goes: one more round a side, each step
timed and the grammar path's parts with it, by wrapping them (`profile`).

On a GPU (`--device cuda`, bf16, either `--kernel-mode`), `--model qwen3-1.7b-shape` serves a folder written on the
spot (bench/shape_model.py): Qwen3-1.7B's shapes with random seeded weights and SmolLM2's tokenizer, so the
embedding and LM head are 49,152 wide, not 151,936. `--layers N` writes it with fewer layers, to try the path on
the CPU first.

Usage, from the repository root:
    python -m bench.structured [--model PATH|qwen3-1.7b-shape] [--layers N] [--device cpu|cuda]
        [--kernel-mode batch_invariant|default] [--rounds 3] [--max-tokens 48] [--profile] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.shape_model import SHAPES, shaped_config, write_shaped_model
from pinned_backend import masks
from pinned_backend.engine import Engine, TokenOutput
from pinned_backend.grammar import Matcher
from pinned_backend.protocol import ChatRequest, parse_request
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams
from pinned_backend.structured import requested_constraint

CONCURRENT = 8
PEOPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer"},
                    "city": {"type": "string"},
                },
                "required": ["name", "age", "city"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
TOPICS = ["scientists", "painters", "athletes", "writers", "musicians", "chefs", "pilots", "architects"]


def prompts(runtime: Runtime) -> list[list[int]]:
    return [
        runtime.tokenizer.encode_chat(
            [{"role": "user", "content": f"List eight famous {topic} with their age and city, as JSON."}]
        )
        for topic in TOPICS
    ]


def json_schema_params(runtime: Runtime, max_tokens: int) -> SamplingParams:
    """Greedy, constrained as a `response_format` `json_schema` request is: through structured.py and the cache."""
    body = parse_request(
        ChatRequest,
        {
            "messages": [{"role": "user", "content": "-"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "people", "schema": PEOPLE_SCHEMA, "strict": True},
            },
        },
    )
    constraint = requested_constraint(body)
    assert constraint is not None
    grammar = runtime.grammars.compile(constraint.grammar)
    return SamplingParams(temperature=0, max_tokens=max_tokens, grammar=grammar)


def serve_all(
    engine: Engine, prompt_ids: list[list[int]], params: SamplingParams
) -> tuple[int, float, list[str]]:
    """(completion tokens, seconds from the first submit to the last token, finish reasons)."""
    outputs: dict[str, list[TokenOutput]] = {}
    start = time.perf_counter()
    for i, ids in enumerate(prompt_ids):
        outputs[f"r{i}"] = []
        engine.submit(f"r{i}", ids, params, outputs[f"r{i}"].append)  # type: ignore[arg-type]
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - start
    tokens = sum(len(out) for out in outputs.values())
    return tokens, seconds, [str(out[-1].finish_reason) for out in outputs.values()]


def profile(engine: Engine, prompt_ids: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Milliseconds per engine step of one more round, by part, timed by wrapping the engine's and the grammar
    path's functions (restored after). On a GPU the forward pass runs asynchronously: the wrappers wait for it
    where the step would next wait anyway (before the masks are applied, before drawing), so that its time is
    counted as the GPU's and not as the part that happened to wait for it."""
    spent: dict[str, float] = defaultdict(float)
    steps = [0]
    originals = (masks._fill, masks.PendingMasks.apply, Matcher.commit, Matcher.state)

    def timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start

        return wrapped

    def gpu_wait(logits: torch.Tensor) -> None:
        if logits.is_cuda:
            timed(GPU_WAIT, torch.cuda.synchronize)(logits.device)

    def apply(pending: masks.PendingMasks, logits: torch.Tensor) -> torch.Tensor:
        gpu_wait(logits)
        timed("main thread: waiting for the masks", pending._done.result)()
        return timed("main thread: applying the masks", originals[1])(pending, logits)

    def sample(logits: torch.Tensor, rows: Any) -> Any:
        gpu_wait(logits)
        return timed("main thread: drawing (argmax, logprobs)", type(engine)._sample)(engine, logits, rows)

    def step() -> None:
        steps[0] += 1
        timed("whole step", type(engine).step)(engine)

    masks._fill = timed("worker thread: computing the masks (beside the forward pass)", originals[0])
    masks.PendingMasks.apply = apply  # type: ignore[method-assign]
    Matcher.commit = timed("main thread: committing tokens to the matchers", originals[2])  # type: ignore[method-assign]
    Matcher.state = timed("main thread: the matchers' states for each token", originals[3])  # type: ignore[method-assign]
    engine.step, engine._sample = step, sample  # type: ignore[method-assign]
    engine._forward = timed("main thread: the forward pass, masks and drawing", engine._forward)  # type: ignore[method-assign]
    try:
        serve_all(engine, prompt_ids, replace(params))
    finally:
        masks._fill, masks.PendingMasks.apply, Matcher.commit, Matcher.state = originals  # type: ignore[method-assign]
        del engine.step, engine._sample, engine._forward
    return {"steps": steps[0], **{part: s * 1e3 / steps[0] for part, s in sorted(spent.items(), key=_order)}}


GPU_WAIT = "main thread: waiting for the forward pass on the GPU"
_ORDER = (
    "whole step",
    "main thread: the forward pass",
    GPU_WAIT,
    "main thread: waiting",
    "main thread: applying",
)


def _order(item: tuple[str, float]) -> int:
    return next((i for i, prefix in enumerate(_ORDER) if item[0].startswith(prefix)), len(_ORDER))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="an HF folder or GGUF file, or qwen3-1.7b-shape (default: SmolLM2)"
    )
    parser.add_argument("--layers", type=int, default=None, help="qwen3-1.7b-shape with this many layers")
    parser.add_argument(
        "--shape-dir", type=Path, default=None, help="where qwen3-1.7b-shape's folder is written"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--kernel-mode", choices=["batch_invariant", "default"], default="batch_invariant")
    parser.add_argument("--kv-cache-mb", default="auto", help="the KV cache's size, as serve takes it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--profile", action="store_true", help="add where the time goes, one more round a side"
    )
    parser.add_argument(
        "--commit", default=None, help="the measured commit, for a copy of the tree without git"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the result as Markdown here")
    args = parser.parse_args()
    model = _model(args)
    settings = BackendSettings(
        model=model,
        threads=args.threads,
        prefix_cache=False,
        device=args.device,
        kernel_mode=args.kernel_mode,
        kv_cache_mb=args.kv_cache_mb,
    )
    runtime = load_runtime(settings)
    engine = runtime.engine
    prompt_ids = prompts(runtime)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    sides = {"json_schema": json_schema_params(runtime, args.max_tokens), "free": free}
    rates: dict[str, list[float]] = {side: [] for side in sides}
    finishes: dict[str, set[str]] = {side: set() for side in sides}
    for round_ in range(args.rounds + 1):
        for side, params in sides.items():
            tokens, seconds, reasons = serve_all(engine, prompt_ids, replace(params))
            if round_ == 0:
                continue  # warm-up
            rates[side].append(tokens / seconds)
            finishes[side].update(reasons)
            print(f"round {round_} {side}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    profiles = {side: profile(engine, prompt_ids, p) for side, p in sides.items()} if args.profile else {}
    report = _report(args, model, runtime, rates, finishes, profiles)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


def _model(args: argparse.Namespace) -> Path:
    if args.model is None:
        return _smollm2()
    if args.model in SHAPES:
        layers = "" if args.layers is None else f"-{args.layers}l"
        folder = args.shape_dir or Path(tempfile.gettempdir()) / f"stackpin-{args.model}{layers}"
        return write_shaped_model(args.model, folder, args.layers, device=args.device)
    if args.layers is not None:
        raise SystemExit(f"--layers applies only to {', '.join(SHAPES)}")
    return Path(args.model)


def _smollm2() -> Path:
    from proxy.replicas.local_backend import SMOLLM2_INSTALL, smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        raise SystemExit(f"SmolLM2's GGUF file is not installed: {SMOLLM2_INSTALL}; or pass --model")
    return found


def _report(
    args: argparse.Namespace,
    model: Path,
    runtime: Runtime,
    rates: dict[str, list[float]],
    finishes: dict[str, set[str]],
    profiles: dict[str, dict[str, float]],
) -> str:
    medians = {side: statistics.median(r) for side, r in rates.items()}
    per_round = [c / f for c, f in zip(rates["json_schema"], rates["free"], strict=True)]
    stack, settings = runtime.stack, runtime.settings
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    software = ", ".join(f"{name} {v}" for name, v in stack["software"].items() if v and name != "backend")
    rows = "\n".join(
        f"| {side} | {medians[side]:.1f} | {', '.join(f'{r:.1f}' for r in rates[side])} | "
        f"{', '.join(sorted(finishes[side]))} |"
        for side in rates
    )
    return f"""# Structured outputs: what a grammar costs the batch

`bench/structured.py`: {CONCURRENT} concurrent greedy chat requests, all submitted at once, served by the engine
directly (as `stackpin-backend serve` assembles it), {args.max_tokens} completion tokens each: constrained to a
`json_schema` response format (an array of at least 8 people, each a name, an age and a city) against the same
prompts unconstrained. Interleaved rounds after one warm-up a side; completion tokens per second over the wall
time from the first submit to the last token, prefill included.

- Command: `python -m bench.structured {shlex.join(sys.argv[1:])}`
- Commit: `{commit}` (the measured code; this file was added after)
- Device: {_device_line(settings, stack)}; {settings.torch_dtype}, `{stack["kernel_mode"]}` kernels
- Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average
  {", ".join(f"{x:.1f}" for x in os.getloadavg())} at the end; {software}
- Model: {_model_line(args, model, stack)}
- Date: {datetime.date.today().isoformat()}

| side | median tok/s | rounds | finish reasons |
| --- | ---: | --- | --- |
{rows}

**json_schema / free: {medians["json_schema"] / medians["free"]:.3f}** (per round:
{", ".join(f"{r:.3f}" for r in per_round)}; target >= 0.9)
{_profile_table(profiles)}"""


def _device_line(settings: BackendSettings, stack: dict[str, Any]) -> str:
    detail = stack["hardware_detail"]
    if settings.device == "cuda":
        plans = detail.get("matmul_plans")
        plan = f", matmul plans `{plans['name']}`" if isinstance(plans, dict) else ""
        graphs = f", steps replayed as CUDA graphs (up to {settings.max_step_graphs})"
        return f"{detail['name']} (compute capability {detail['compute_capability']}){graphs}{plan}"
    return f"{detail.get('cpu_model')} ({stack['hardware']}), {detail.get('threads')} torch threads"


def _model_line(args: argparse.Namespace, model: Path, stack: dict[str, Any]) -> str:
    if args.model not in SHAPES:
        return f"`{stack['model']}` ({stack['quantisation']}), `{model.name}`"
    config = shaped_config(args.model, args.layers)
    return (
        f"`{args.model}`: {SHAPES[args.model].name}'s shapes ({config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, intermediate {config['intermediate_size']}, {config['num_attention_heads']} query / "
        f"{config['num_key_value_heads']} KV heads of {config['head_dim']}, tied embeddings) with random seeded "
        f"weights ({stack['quantisation']}) and SmolLM2's tokenizer, so the embedding and LM head are "
        f"{config['vocab_size']} wide, not {_real_vocab(args.model)}: the speed of a model of that size, never its "
        "answers"
    )


def _real_vocab(name: str) -> int:
    return int(json.loads((SHAPES[name] / "config.json").read_text())["vocab_size"])


def _profile_table(profiles: dict[str, dict[str, float]]) -> str:
    if not profiles:
        return ""
    parts = list(dict.fromkeys(part for p in profiles.values() for part in p if part != "steps"))
    rows = "\n".join(
        f"| {part} | " + " | ".join(f"{p[part]:.3f}" if part in p else "-" for p in profiles.values()) + " |"
        for part in parts
    )
    sides = " | ".join(f"{side} ({p['steps']:.0f} steps)" for side, p in profiles.items())
    return f"""
Where the time goes (`--profile`: one more round a side, milliseconds per engine step; the worker thread's time
overlaps the forward pass, the main thread's parts are within the whole step):

| part | {sides} |
| --- | {" | ".join("---:" for _ in profiles)} |
{rows}
"""


if __name__ == "__main__":
    main()
