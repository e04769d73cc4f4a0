"""What a grammar costs the batch: completion tokens per second of 8 concurrent `json_schema` requests against 8
unconstrained ones, side by side, on the embedded default model (SmolLM2-135M-Instruct) unless told otherwise.

The backend is assembled as `stackpin-backend serve` assembles it (runtime.py) and its engine is driven directly,
so the figures measure the engine, the masks and the kernels rather than HTTP. Each round serves the same 8 chat
prompts twice, greedy, all 8 submitted at once: once constrained to a JSON schema (an array of people, each with a
name, an age and a city: compiled through the server's own path, response_format's), once free. The constrained
answers run to max_tokens (the schema asks for more than fits); a free one may end sooner, which only makes the
free side's later steps cheaper; the finish reasons are reported. The sides alternate for `--rounds` rounds after
one uncounted warm-up each, each side first in every other round; the medians and their ratio are printed, for
completion tokens per second (the 8 answers' tokens over the wall time from the first submit to the last token,
prefill included) and for this process's CPU time per token, which the machine's other work disturbs less. The
engine's step statistics also say how much of a constrained step went on grammars after its forward pass (waiting
for masks the forward pass did not hide, and applying them).

Usage, from the repository root:
    python -m bench.structured [--model PATH] [--rounds 7] [--max-tokens 24] [--threads N]
        [--out bench/results/structured.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pinned_backend.engine import Engine, StepStats, TokenOutput
from pinned_backend.protocol import ChatRequest, parse_request
from pinned_backend.runtime import BackendSettings, Runtime, load_runtime
from pinned_backend.sampling import SamplingParams
from pinned_backend.stack import detect_hardware
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


class Steps:
    """The engine's step statistics, summed: seconds, and seconds spent on grammars after the forward pass."""

    def __init__(self) -> None:
        self.count, self.seconds, self.grammar_seconds = 0, 0.0, 0.0

    def __call__(self, stats: StepStats) -> None:
        self.count += 1
        self.seconds += stats.seconds
        self.grammar_seconds += stats.grammar_seconds


@dataclass
class Side:
    """One side's counted rounds: completion tokens, wall seconds and this process's CPU seconds (every thread's:
    the engine's, the masks' worker and llguidance's), and how its answers ended."""

    params: SamplingParams
    rounds: list[tuple[int, float, float]] = field(default_factory=list)
    finishes: set[str] = field(default_factory=set)

    def rates(self) -> list[float]:
        return [tokens / wall for tokens, wall, _ in self.rounds]

    def cpu_ms_per_token(self) -> list[float]:
        return [cpu / tokens * 1e3 for tokens, _, cpu in self.rounds]


def serve_all(
    engine: Engine, prompt_ids: list[list[int]], params: SamplingParams
) -> tuple[int, float, float, list[str]]:
    """(completion tokens, wall seconds from the first submit to the last token, CPU seconds, finish reasons)."""
    outputs: dict[str, list[TokenOutput]] = {}
    start, cpu = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompt_ids):
        outputs[f"r{i}"] = []
        engine.submit(f"r{i}", ids, params, outputs[f"r{i}"].append)  # type: ignore[arg-type]
    while engine.has_work():
        engine.step()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(out) for out in outputs.values())
    return tokens, seconds, cpu, [str(out[-1].finish_reason) for out in outputs.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=None, help="an HF folder or GGUF file (default: SmolLM2)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the result as Markdown here")
    args = parser.parse_args()
    model = args.model or _smollm2()
    settings = BackendSettings(model=model, threads=args.threads, prefix_cache=False)
    steps = Steps()
    runtime = load_runtime(settings, on_step=steps)
    prompt_ids = prompts(runtime)
    sides = {
        "json_schema": Side(json_schema_params(runtime, args.max_tokens)),
        "free": Side(SamplingParams(temperature=0, max_tokens=args.max_tokens)),
    }
    grammar = Steps()  # the constrained side's counted steps
    for round_ in range(args.rounds + 1):
        # Each side goes first every other round, so that a drift in the machine's load favours neither.
        for name in sorted(sides, reverse=round_ % 2 == 1):
            side = sides[name]
            before = (steps.count, steps.seconds, steps.grammar_seconds)
            tokens, wall, cpu, reasons = serve_all(runtime.engine, prompt_ids, side.params)
            if round_ == 0:
                continue  # warm-up
            if name == "json_schema":
                grammar.count += steps.count - before[0]
                grammar.seconds += steps.seconds - before[1]
                grammar.grammar_seconds += steps.grammar_seconds - before[2]
            side.rounds.append((tokens, wall, cpu))
            side.finishes.update(reasons)
            print(
                f"round {round_} {name}: {tokens} tokens, {wall:.2f} s, {cpu:.2f} s CPU: {tokens / wall:.1f} tok/s"
            )
    report = _report(args, model, runtime, sides, grammar)
    print(report)
    if args.out is not None:
        args.out.write_text(report)


def _smollm2() -> Path:
    from proxy.local_backend import SMOLLM2_INSTALL, smollm2_gguf

    found = smollm2_gguf()
    if found is None:
        raise SystemExit(f"SmolLM2's GGUF file is not installed: {SMOLLM2_INSTALL}; or pass --model")
    return found


def _report(
    args: argparse.Namespace, model: Path, runtime: Runtime, sides: dict[str, Side], grammar: Steps
) -> str:
    generation, detail = detect_hardware(torch.device("cpu"))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    command = f"python -m bench.structured --rounds {args.rounds} --max-tokens {args.max_tokens}"
    if args.threads:
        command += f" --threads {args.threads}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    constrained, free = sides["json_schema"], sides["free"]
    ratio = statistics.median(constrained.rates()) / statistics.median(free.rates())
    per_round = [c / f for c, f in zip(constrained.rates(), free.rates(), strict=True)]
    cpu_ratio = statistics.median(free.cpu_ms_per_token()) / statistics.median(constrained.cpu_ms_per_token())
    rows = "\n".join(
        f"| {name} | {statistics.median(side.rates()):.1f} | {', '.join(f'{r:.1f}' for r in side.rates())} | "
        f"{statistics.median(side.cpu_ms_per_token()):.1f} | {', '.join(sorted(side.finishes))} |"
        for name, side in sides.items()
    )
    return f"""# Structured outputs: what a grammar costs the batch

`bench/structured.py`: {CONCURRENT} concurrent greedy chat requests, all submitted at once, served by the engine
directly (as `stackpin-backend serve` assembles it; `{runtime.stack["kernel_mode"]}` kernels), {args.max_tokens}
completion tokens each: constrained to a `json_schema` response format (an array of at least 8 people, each a
name, an age and a city) against the same prompts unconstrained. Interleaved rounds after one warm-up a side, each
side first in every other round; completion tokens per second over the wall time from the first submit to the last
token, prefill included, and this process's CPU time per token (all its threads: the masks' too), which other work
on the machine disturbs far less than the wall time.

- Command: `{command}`
- Commit: `{commit}` (the measured code; this file was added after)
- Machine: {platform.machine()}, {detail.get("cpu_model")} ({generation}), {detail.get("threads")} torch thread(s),
  {os.cpu_count()} CPUs, load average {load} at the end (shared with other work while it ran); torch
  {torch.__version__}
- Model: `{runtime.stack["model"]}` ({runtime.stack["quantisation"]}), `{model.name}`
- Date: {datetime.date.today().isoformat()}

| side | median tok/s | rounds | median CPU ms / token | finish reasons |
| --- | ---: | --- | ---: | --- |
{rows}

**json_schema / free, tokens per second: {ratio:.3f}** (medians; per round {", ".join(f"{r:.3f}" for r in per_round)};
target >= 0.9). Tokens per CPU second: **{cpu_ratio:.3f}**.

Grammar time after the forward pass, over the counted constrained rounds: {grammar.grammar_seconds * 1e3:.1f} ms in \
{grammar.count} steps of {grammar.seconds:.1f} s: {grammar.grammar_seconds / grammar.count * 1e3:.2f} ms a step, \
{grammar.grammar_seconds / grammar.seconds:.2%} of the steps' time (the masks themselves are computed while the \
forward pass runs).
"""


if __name__ == "__main__":
    main()
