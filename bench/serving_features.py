"""What the prefix cache and prompt lookup buy, and what invariance costs with them on, measured side by side.

The engine is driven directly (as the backend's worker thread drives it), on the CPU or on a GPU, where both kernel
modes replay their steps as CUDA graphs. Three parts, each timing its two sides in interleaved rounds:

1. `ttft`: time to first token of a request whose 2,000-token prompt shares its first 1,800 tokens (90%) with one
   served just before, against the cold request served just before it (the one then cached). Prompts are random
   token ids; `batch_invariant` kernels, the prefix cache on, `max_step_tokens` 256.
2. `lookup`: decode tokens per second with prompt lookup (`--drafts` tokens) against without, at batch 1 and 8, on a
   copy-heavy workload: each prompt holds a text and then the start of it again, so a model that copies writes the
   text out a second time. The text is the model's own greedy continuation of the start (a random seed of 32
   token ids), so that even random weights are given a text they would write; whether the model then copies it is
   its business, and the acceptance rate says how much it did. `batch_invariant` kernels.
3. `modes`: `batch_invariant` against `default` decode tokens per second with the same features on (prefix cache,
   prompt lookup), at batch 1, 8, 32 and 128: each request a shared 64-token system prompt and a copy-heavy prompt.

Decode tokens per second counts the tokens emitted by steps that prefilled nothing, over those steps' time (their
host work included: sampling, drafting, emitting). Models: `--model DIR` loads a checkpoint folder (the tiny model,
`stackpin-backend make-tiny DIR`); `--model qwen3-1.7b-random` builds bench/gpu_price.py's Qwen3-1.7B-shaped model
with random seeded weights (GPU only).

Usage, from the repository root:
    python -m bench.serving_features OUT.json --model DIR [--device cpu|cuda] [--parts ttft,lookup,modes]
        [--rounds 3] [--drafts 4] [--batches 1,8,32,128]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pinned_backend.checkpoint import ModelConfig, load_config, load_weights
from pinned_backend.engine import Engine, EngineConfig, StepStats, TokenOutput
from pinned_backend.kernels import KERNEL_MODES, select_kernels
from pinned_backend.kvcache import BlockAllocator, PagedKVCache
from pinned_backend.model import Transformer, matmul_shapes
from pinned_backend.sampling import SamplingParams
from pinned_backend.stack import detect_hardware

BLOCK = 16
PROMPT, SHARED = 2000, 1800
SEED_TOKENS, TEXT_TOKENS = 32, 192
SYSTEM_TOKENS = 64
COPIES = 16  # distinct copy-heavy prompts; larger batches repeat them
GRAPHS = 256  # CUDA graphs kept: enough that timed rounds replay rather than capture


@dataclass
class Setup:
    models: dict[str, Transformer]  # by kernel mode
    device: torch.device
    # One engine per configuration, kept across rounds: its CUDA graphs are captured in the uncounted warm-ups and
    # replayed after, as a serving backend's are. Each has a KV cache of its own.
    engines: dict[tuple[Any, ...], Engine] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.models["batch_invariant"].config.vocab_size

    def engine(self, mode: str, *, batch: int, step_tokens: int, drafts: int, blocks: int) -> Engine:
        key = (mode, batch, step_tokens, drafts, blocks)
        if key not in self.engines:
            model = self.models[mode]
            cache = PagedKVCache(model.config, blocks, BLOCK, self.device, model.dtype)
            config = EngineConfig(
                max_model_len=min(model.config.max_position_embeddings, 4096),
                num_blocks=blocks,
                block_size=BLOCK,
                max_batch_size=batch,
                max_step_tokens=step_tokens,
                max_queue=1024,
                step_graphs=GRAPHS if self.device.type == "cuda" else 0,
                prefix_cache=True,
                speculative_tokens=drafts,
            )
            allocator = BlockAllocator(blocks)
            self.engines[key] = Engine(
                model, cache, allocator, model.kernels, config, lambda ids: "", self.device
            )
        return self.engines[key]

    def release(self) -> None:
        self.engines.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def blocks_for(batch: int, tokens: int) -> int:
    """KV blocks for `batch` requests of `tokens` tokens, twice over: room for the prefix cache to keep a round."""
    return 2 * batch * -(-tokens // BLOCK) + 16


def load(model: str, device: torch.device) -> Setup:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if model == "qwen3-1.7b-random":
        from bench.gpu_price import qwen3_1_7b, random_weights

        config = qwen3_1_7b()
        weights = random_weights(config, seed=0)
    else:
        config = load_config(Path(model))
        weights = load_weights(Path(model), config, dtype)
    models = {}
    for mode in KERNEL_MODES:
        kernels = select_kernels(mode, device, matmul_plans=served_plans(config, device))
        models[mode] = Transformer(config, dict(weights), kernels, device, dtype)
    return Setup(models, device)


def served_plans(config: ModelConfig, device: torch.device) -> Any:
    """The matmul plan file `stackpin-backend serve --matmul-plans auto` would take on this device (None on a CPU)."""
    if device.type != "cuda":
        return None
    from pinned_backend.kernels.triton.plan_files import plan_file_for, running_on

    return plan_file_for(running_on(device), set(matmul_shapes(config).values()), "auto")


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[TokenOutput]]:
    outs: list[list[TokenOutput]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.submit(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens), outs[i].append)
    while engine.has_work():
        engine.step()
    return outs


def ttft(setup: Setup, rounds: int, rng: random.Random) -> dict[str, Any]:
    engine = setup.engine(
        "batch_invariant", batch=16, step_tokens=256, drafts=0, blocks=blocks_for(4, PROMPT)
    )

    def first_token(prompt: list[int]) -> tuple[float, int]:
        got: list[TokenOutput] = []
        start = time.perf_counter()
        engine.submit(
            f"t{rng.getrandbits(32)}", prompt, SamplingParams(temperature=0, max_tokens=1), got.append
        )
        while not got:
            engine.step()
        return time.perf_counter() - start, got[0].batch.cached_tokens

    samples = []
    for r in range(rounds + 1):  # round 0 compiles and captures; it is not counted
        cached = [setup_token(rng, setup) for _ in range(PROMPT)]
        cold_s, _ = first_token(cached)
        hit_s, hit_tokens = first_token(
            cached[:SHARED] + [setup_token(rng, setup) for _ in range(PROMPT - SHARED)]
        )
        if r:
            samples.append(
                {"cold_s": cold_s, "hit_s": hit_s, "ratio": hit_s / cold_s, "cached_tokens": hit_tokens}
            )
    return {
        "prompt_tokens": PROMPT,
        "shared_tokens": SHARED,
        "rounds": samples,
        "cold_ms_median": 1e3 * statistics.median(s["cold_s"] for s in samples),
        "hit_ms_median": 1e3 * statistics.median(s["hit_s"] for s in samples),
        "ratio_median": statistics.median(s["ratio"] for s in samples),
    }


def setup_token(rng: random.Random, setup: Setup) -> int:
    return rng.randrange(setup.vocab)


def copy_prompts(setup: Setup, rng: random.Random) -> list[list[int]]:
    """COPIES prompts `seed + text + seed`, the text being the model's greedy continuation of the seed."""
    seeds = [[setup_token(rng, setup) for _ in range(SEED_TOKENS)] for _ in range(COPIES)]
    engine = setup.engine(
        "batch_invariant",
        batch=COPIES,
        step_tokens=1024,
        drafts=0,
        blocks=blocks_for(COPIES, 2 * TEXT_TOKENS),
    )
    texts = serve(engine, seeds, TEXT_TOKENS)
    return [seed + [o.token_id for o in text] + seed for seed, text in zip(seeds, texts, strict=True)]


def decode_rate(
    setup: Setup, mode: str, prompts: list[list[int]], drafts: int, max_tokens: int
) -> dict[str, Any]:
    """Serve `prompts` at once; the decode-only steps' emitted tokens per second."""
    stats: list[StepStats] = []
    batch = len(prompts)
    blocks = blocks_for(batch, max(len(p) for p in prompts) + max_tokens)
    engine = setup.engine(mode, batch=batch, step_tokens=max(256, 4 * batch), drafts=drafts, blocks=blocks)
    engine.on_step = stats.append
    serve(engine, prompts, max_tokens)
    decode = [s for s in stats if s.sequences and s.prefill_tokens == 0]
    tokens = sum(s.sequences + s.accepted_draft_tokens for s in decode)
    seconds = sum(s.seconds for s in decode)
    drafted = sum(s.draft_tokens for s in decode)
    return {
        "tokens_per_s": tokens / seconds,
        "decode_steps": len(decode),
        "step_ms_mean": 1e3 * seconds / len(decode),
        "tokens_per_sequence_step": tokens / sum(s.sequences for s in decode),
        "drafted": drafted,
        "accepted": sum(s.accepted_draft_tokens for s in decode),
        "captures": sum(s.launch == "capture" for s in stats),
    }


def paired(
    rounds: int, sides: dict[str, Callable[[], dict[str, Any]]], numerator: str, denominator: str
) -> dict[str, Any]:
    """Each side once per round, their order alternating, after two uncounted warm-ups of each (the first serves
    cold, the second from the prefix cache: each prefills in other steps, so each captures graphs); the median
    ratio."""
    for _ in range(2):
        for run in sides.values():
            run()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            results[name].append(sides[name]())
    ratios = [
        a["tokens_per_s"] / b["tokens_per_s"]
        for a, b in zip(results[numerator], results[denominator], strict=True)
    ]
    return {**results, "ratio_median": statistics.median(ratios), "ratios": ratios}


def lookup(
    setup: Setup, prompts: list[list[int]], rounds: int, drafts: int, batches: list[int]
) -> dict[str, Any]:
    out = {}
    for batch in batches:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        out[str(batch)] = paired(
            rounds,
            {
                "on": lambda c=chosen: decode_rate(setup, "batch_invariant", c, drafts, TEXT_TOKENS),
                "off": lambda c=chosen: decode_rate(setup, "batch_invariant", c, 0, TEXT_TOKENS),
            },
            "on",
            "off",
        )
        print("lookup", batch, json.dumps(_brief(out[str(batch)])), flush=True)
    return out


def modes(
    setup: Setup, prompts: list[list[int]], rounds: int, drafts: int, batches: list[int], rng: random.Random
) -> dict[str, Any]:
    system = [setup_token(rng, setup) for _ in range(SYSTEM_TOKENS)]
    out = {}
    for batch in batches:
        chosen = [system + prompts[i % len(prompts)] for i in range(batch)]
        out[str(batch)] = paired(
            rounds,
            {
                mode: lambda m=mode, c=chosen: decode_rate(setup, m, c, drafts, 64)  # type: ignore[misc]
                for mode in ("batch_invariant", "default")
            },
            "batch_invariant",
            "default",
        )
        print("modes", batch, json.dumps(_brief(out[str(batch)])), flush=True)
    return out


def _brief(result: dict[str, Any]) -> dict[str, Any]:
    sides = {k: v for k, v in result.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
    brief = {k: [round(r["tokens_per_s"], 1) for r in v] for k, v in sides.items()}
    accepted = {k: [f"{r['accepted']}/{r['drafted']}" for r in v] for k, v in sides.items()}
    return {"tokens_per_s": brief, "accepted": accepted, "ratio_median": round(result["ratio_median"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", required=True, help="a checkpoint folder, or qwen3-1.7b-random (cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--parts", default="ttft,lookup,modes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drafts", type=int, default=4, help="prompt lookup's draft tokens a step")
    parser.add_argument("--batches", default="1,8,32,128", help="batch sizes of the modes part")
    args = parser.parse_args()
    device = torch.device(args.device)
    rng = random.Random(21)
    started = time.perf_counter()
    setup = load(args.model, device)
    report: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else detect_hardware(device)[1]["cpu_model"],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "drafts": args.drafts,
        "rounds": args.rounds,
    }
    parts = args.parts.split(",")
    with torch.inference_mode():
        if "ttft" in parts:
            report["ttft"] = ttft(setup, args.rounds, rng)
            setup.release()
            print("ttft", json.dumps({k: v for k, v in report["ttft"].items() if k != "rounds"}), flush=True)
        prompts = copy_prompts(setup, rng) if {"lookup", "modes"} & set(parts) else []
        if "lookup" in parts:
            report["lookup"] = lookup(setup, prompts, args.rounds, args.drafts, [1, 8])
            setup.release()
        if "modes" in parts:
            batches = [int(b) for b in args.batches.split(",")]
            report["modes"] = modes(setup, prompts, args.rounds, args.drafts, batches, rng)
    report["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report)


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['model']} on {r['device']}, torch {r['torch']}, {r['drafts']} drafts, {r['rounds']} rounds")
    if "ttft" in r:
        t = r["ttft"]
        print(
            f"ttft {t['prompt_tokens']} tokens, {t['shared_tokens']} cached: hit {t['hit_ms_median']:.1f} ms, "
            f"cold {t['cold_ms_median']:.1f} ms, ratio {t['ratio_median']:.3f}"
        )
    for part, (a, b) in (("lookup", ("on", "off")), ("modes", ("batch_invariant", "default"))):
        for batch, row in r.get(part, {}).items():
            acc = sum(x["accepted"] for x in row[a]), sum(x["drafted"] for x in row[a])
            print(
                f"{part} batch {batch:>3}: {a} {statistics.median(x['tokens_per_s'] for x in row[a]):9.1f} tok/s, "
                f"{b} {statistics.median(x['tokens_per_s'] for x in row[b]):9.1f} tok/s, ratio "
                f"{row['ratio_median']:.3f} (drafts accepted {acc[0]}/{acc[1]})"
            )


if __name__ == "__main__":
    main()
