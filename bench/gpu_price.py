"""The price of reproducibility on one GPU, measured side by side in one run.

A Qwen3-1.7B-shaped model (28 layers, hidden 2048, intermediate 6144, 16 query / 8 KV heads of 128, vocabulary
151936, tied embeddings) with random seeded bf16 weights: no checkpoint can be downloaded where this runs, so the
numbers are about speed and bit-reproducibility, never about answer quality. The model is the project's own
`Transformer` (and, for the divergence experiment, its `Engine`), run in two kernel modes:

- `batch_invariant`: `TritonKernels`, every reduction in a fixed order per row.
- `default`: the same, except that matmuls go to cuBLAS (`F.linear`), the op whose reduction order follows the
  batch. RMSNorm, the fused elementwise kernels, log-softmax and attention stay the Triton kernels in both modes,
  so the ratio prices the matmul alone; the project's CPU-friendly `TorchKernels` attention loops over sequences
  on the host and would make `default` look slower than it is on a GPU.

Measured: matmul TFLOP/s against cuBLAS at the model's shapes for M = 1..512; decode throughput (CUDA graph per
step) and prefill throughput (one CUDA graph per step, and eager) at batch 1, 8, 32, 128; decode step time against
the bandwidth floor (weight bytes over the measured copy bandwidth); the divergence experiment: one prompt sent 1000
times at temperature 0 through the engine amid random concurrent requests, in each mode. The invariant matmuls
take the plan file the backend would (`--matmul-plans`, as `stackpin-backend serve` takes it).
Usage: python -m bench.gpu_price OUT.json [--parts speed,divergence] [--matmul-plans auto|none|FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pinned_backend.checkpoint import ModelConfig, expected_shapes
from pinned_backend.engine import Engine, EngineConfig, EngineError, TokenOutput
from pinned_backend.kernels import Kernels, select_kernels
from pinned_backend.kernels.triton import TritonKernels
from pinned_backend.kernels.triton.plan_files import plan_file_for, running_on
from pinned_backend.kernels.triton.timing import time_interleaved, weight_copies
from pinned_backend.kernels.triton.tuner import compile_ahead, default_workers
from pinned_backend.kvcache import BlockAllocator, PagedKVCache
from pinned_backend.model import Transformer, matmul_shapes
from pinned_backend.sampling import SamplingParams
from pinned_backend.step_graphs import DEFAULT_MAX_GRAPHS

MODES = ("default", "batch_invariant")
BATCHES = [1, 8, 32, 128]
MATMUL_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
PAGE = 16
CONTEXT = 512  # prompt tokens per sequence before decode is timed
DECODE_STEPS = 64
DEVICE = "cuda"


def qwen3_1_7b() -> ModelConfig:
    return ModelConfig(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=True,
    )


def random_weights(
    config: ModelConfig, seed: int, embed_std: float = 1.0, device: str = DEVICE
) -> dict[str, torch.Tensor]:
    """Seeded weights on `device` (one seed draws other numbers on another device): matrices with std 1/sqrt(fan_in), embeddings std `embed_std`, norms near 1.

    With tied embeddings the embedding std sets the logits' spread: at 1.0 (the speed runs) the logits have a
    std near 45 and the top token wins by whole units, so no last-bit change can flip it; at 0.02 (Hugging
    Face's initialisation) they spread like a real model's, with near-ties."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, device=device, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = embed_std * torch.randn(shape, device=device, generator=gen)
        else:
            t = torch.randn(shape, device=device, generator=gen) / math.sqrt(shape[1])
        out[name] = t.to(torch.bfloat16)
    return out


def bench_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=25, return_mode="median"))


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / bench_ms(lambda: dst.copy_(src)) / 1e9  # TB/s, read + write


def matmul_table(model: Transformer) -> list[dict[str, Any]]:
    layer = model.layers[0]
    weights = {"qkv": layer.qkv, "o_proj": layer.o, "gate_up": layer.gate_up, "down": layer.down}
    weights["lm_head"] = model.lm_head
    rows = []
    for name, w in weights.items():
        n, k = w.shape
        x = torch.randn(512, k, device=DEVICE, dtype=torch.bfloat16)
        copies = weight_copies(w)
        for m in MATMUL_M:
            flop = 2 * m * n * k
            us_inv, us_ref = time_interleaved([model.kernels.matmul, F.linear], x[:m], copies)
            rows.append(
                {
                    "weight": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "invariant_us": us_inv,
                    "cublas_us": us_ref,
                    "invariant_tflops": flop / us_inv / 1e6,
                    "cublas_tflops": flop / us_ref / 1e6,
                    "ratio": us_inv / us_ref,
                }
            )
    return rows


def _fill(
    model: Transformer, cache: PagedKVCache, tables: torch.Tensor, length: int, gen: torch.Generator
) -> None:
    """Prefill `length` random tokens for every row of `tables`, a few sequences per step."""
    batch = tables.shape[0]
    per_step = max(1, 16384 // length)
    for lo in range(0, batch, per_step):
        seqs = torch.arange(lo, min(batch, lo + per_step), dtype=torch.int32, device=DEVICE)
        seq = seqs.repeat_interleave(length)
        pos = torch.arange(length, dtype=torch.int32, device=DEVICE).repeat(len(seqs))
        tokens = torch.randint(model.config.vocab_size, (len(seq),), device=DEVICE, generator=gen)
        last = torch.arange(1, len(seqs) + 1, device=DEVICE) * length - 1
        model.forward(tokens, seq, pos, tables, cache, last)


def decode_rate(model: Transformer, cache: PagedKVCache, batch: int) -> dict[str, float]:
    """Greedy decode steps of `batch` sequences at context CONTEXT, each step one CUDA graph replay."""
    gen = torch.Generator(device=DEVICE).manual_seed(batch)
    blocks = -(-(CONTEXT + DECODE_STEPS + 4) // PAGE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=DEVICE).view(batch, blocks)
    _fill(model, cache, tables, CONTEXT, gen)
    tokens = torch.randint(model.config.vocab_size, (batch,), device=DEVICE, generator=gen)
    seq = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    pos = torch.full((batch,), CONTEXT, dtype=torch.int32, device=DEVICE)
    rows = torch.arange(batch, device=DEVICE)

    def step() -> None:
        logits = model.forward(tokens, seq, pos, tables, cache, rows)
        tokens.copy_(logits.argmax(-1))
        pos.add_(1)

    _warm_up(step)
    eager_start, eager_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pos.fill_(CONTEXT)
    eager_start.record()
    for _ in range(4):
        step()
    eager_end.record()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    pos.fill_(CONTEXT)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    pos.fill_(CONTEXT)
    start.record()
    for _ in range(DECODE_STEPS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / DECODE_STEPS
    del graph
    return {
        "step_ms": step_ms,
        "eager_step_ms": eager_start.elapsed_time(eager_end) / 4,
        "tokens_per_s": batch / step_ms * 1e3,
    }


def step_profile(model: Transformer, cache: PagedKVCache) -> dict[str, Any]:
    """Kernels in one eager decode step at batch 1 and their summed GPU time, by family: what a step is made of,
    apart from launch gaps."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    blocks = -(-(CONTEXT + 8) // PAGE)
    tables = torch.arange(blocks, dtype=torch.int32, device=DEVICE).view(1, blocks)
    _fill(model, cache, tables, CONTEXT, gen)
    tokens = torch.randint(model.config.vocab_size, (1,), device=DEVICE, generator=gen)
    seq = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pos = torch.full((1,), CONTEXT, dtype=torch.int32, device=DEVICE)
    rows = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    model.forward(tokens, seq, pos, tables, cache, rows)
    torch.cuda.synchronize()
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.forward(tokens, seq, pos, tables, cache, rows)
            torch.cuda.synchronize()
        families: dict[str, list[float]] = {}
        for e in prof.key_averages():
            us = float(getattr(e, "device_time_total", 0.0))
            if us <= 0:
                continue
            name = e.key.lower()
            family = next(
                (f for f, keys in _FAMILIES.items() if any(k in name for k in keys)),
                "other (elementwise, copies, indexing)",
            )
            n, t = families.get(family, [0, 0.0])
            families[family] = [n + e.count, t + us]
        return {f: {"kernels": int(n), "gpu_us": t} for f, (n, t) in families.items()}
    except Exception as exc:  # the profile is a diagnosis; its absence must not sink the run
        return {"error": repr(exc)[:300]}


_FAMILIES = {
    # First, since "_expert_matmul_kernel" holds "_matmul_kernel": a mixture-of-experts layer's grouped expert matmul
    # and sum by rank (expert_matmul.py); torch's grouped GEMM in default mode is CUTLASS, counted with cuBLAS.
    "experts (Triton grouped matmul)": ("_expert_matmul_kernel",),
    "experts' sum by rank": ("_combine_kernel",),
    # The `tl.dot` kernels and the Gluon ones (matmul_gluon.py, matmul_gluon_swapped.py: "_specialized_kernel" names
    # "_swapped_specialized_kernel" too).
    "matmul (Triton)": (
        "_matmul_kernel",
        "_matmul_stream_kernel",
        "_specialized_kernel",
        "_pipelined_kernel",
        "_swapped_kernel",
    ),
    "matmul (cuBLAS)": ("gemm", "gemv", "nvjet", "cutlass", "splitk"),
    "attention": ("_paged_attention", "_latent_attention"),
    "rms_norm and residual add": ("_rms_norm", "_add_rms_norm"),
    "q/k norm, RoPE and cache write": ("_qkv_rope_cache",),
    "SiLU or GELU times up": ("_gated_kernel",),
    "log_softmax": ("_log_softmax",),
    # Last, so that the names above win: a mixture-of-experts layer's routing (torch's ops in capacity routing).
    "routing and dispatch": (
        "_route_kernel",
        "_dispatch_kernel",
        "softmax",
        "sort",
        "radix",
        "scan",
        "search",
        "scatter",
    ),
}


def prefill_rate(model: Transformer, cache: PagedKVCache, batch: int) -> dict[str, Any]:
    """One step that prefills `batch` prompts of CONTEXT tokens each: replayed from a CUDA graph, as the backend
    serves `batch_invariant` steps (step_graphs.py), and launched eagerly, where the host's launch path shows."""
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + batch)
    blocks = -(-CONTEXT // PAGE)
    tables = torch.arange(batch * blocks, dtype=torch.int32, device=DEVICE).view(batch, blocks)
    seq = torch.arange(batch, dtype=torch.int32, device=DEVICE).repeat_interleave(CONTEXT)
    pos = torch.arange(CONTEXT, dtype=torch.int32, device=DEVICE).repeat(batch)
    tokens = torch.randint(model.config.vocab_size, (len(seq),), device=DEVICE, generator=gen)
    last = torch.arange(1, batch + 1, device=DEVICE) * CONTEXT - 1

    def step() -> torch.Tensor:
        return model.forward(tokens, seq, pos, tables, cache, last)

    _warm_up(step)
    eager_ms = _median_ms(step)
    eager_logits = step().clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_logits = step()
    graph.replay()
    # The graph must replay the eager step's arithmetic, TMA descriptors and slice counters included.
    same_bits = torch.equal(graph_logits, eager_logits)
    graph_ms = _median_ms(graph.replay)
    del graph, graph_logits
    return {
        "graph_bits_equal_eager": same_bits,
        "step_ms": graph_ms,
        "tokens_per_s": batch * CONTEXT / graph_ms * 1e3,
        "eager_step_ms": eager_ms,
        "eager_tokens_per_s": batch * CONTEXT / eager_ms * 1e3,
    }


def _warm_up(step: Any) -> None:
    """Two runs on a side stream, as graph capture wants: the first compiles, and cuBLAS loads kernels lazily on
    first use of a shape (after one warm-up run a default-mode step of 512 tokens took 13.3 ms, against 10.2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)


def _median_ms(fn: Any, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[runs // 2]


def weight_bytes(model: Transformer) -> int:
    per_layer = [model.layers[0].qkv, model.layers[0].o, model.layers[0].gate_up, model.layers[0].down]
    layer = sum(w.numel() * w.element_size() for w in per_layer)
    return layer * len(model.layers) + model.lm_head.numel() * model.lm_head.element_size()


# The divergence experiment's load: up to 64 sequences and STEP_TOKENS tokens a step (chunked prefill, as
# production servers batch 2048 to 8192 tokens a step), background prompts of 1..MAX_NOISE_PROMPT tokens.
STEP_TOKENS = 2048
MAX_NOISE_PROMPT = 1500
# Requests arriving before each step (uniform over 0..ARRIVALS_MAX) while fewer than QUEUE_MAX wait.
ARRIVALS_MAX = 6
QUEUE_MAX = 32


def _engine(
    model: Transformer, kernels: Kernels, num_blocks: int, on_step: Any = None, graphs: bool | None = None
) -> Engine:
    """`graphs`: replay steps from CUDA graphs (None: in batch_invariant mode only, the dense experiment's choice)."""
    graphed = kernels.mode == "batch_invariant" if graphs is None else graphs
    cache = PagedKVCache(model.config, num_blocks, PAGE, torch.device(DEVICE), torch.bfloat16)
    config = EngineConfig(
        max_model_len=MAX_NOISE_PROMPT + 64,
        num_blocks=num_blocks,
        block_size=PAGE,
        max_batch_size=64,
        max_step_tokens=STEP_TOKENS,
        max_queue=100000,
        step_graphs=DEFAULT_MAX_GRAPHS if graphed else 0,
    )
    allocator = BlockAllocator(num_blocks)
    return Engine(model, cache, allocator, kernels, config, lambda ids: "", device=DEVICE, on_step=on_step)


def divergence(
    model: Transformer, kernels: Kernels, trials: int, seed: int, budget_s: float, graphs: bool | None = None
) -> dict[str, Any]:
    """The same greedy request `trials` times amid random concurrent requests, through the engine (`graphs` as
    `_engine` takes it)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(32)]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, top_logprobs=5)
    outputs: dict[str, list[int]] = {}
    logprobs: dict[str, list[Any]] = {}  # per token: (its logprob, the top 5 (id, logprob))
    batches: dict[str, tuple[int, int]] = {}
    step_tokens: list[int] = []  # tokens in each step of the loaded run, in order
    step_of: dict[str, list[int]] = {}  # for each request, the steps that produced its tokens
    step_seconds: list[float] = []

    def sink_for(rid: str) -> Any:
        def sink(event: TokenOutput | EngineError) -> None:
            if isinstance(event, EngineError):
                raise RuntimeError(f"{rid}: {event}")
            outputs.setdefault(rid, []).append(event.token_id)
            logprobs.setdefault(rid, []).append((event.logprob, event.top_logprobs))
            batches[rid] = (event.batch.min, event.batch.max)
            step_of.setdefault(rid, []).append(len(step_tokens))

        return sink

    alone = _engine(model, kernels, num_blocks=8, graphs=graphs)
    alone.submit("alone", prompt, greedy, sink_for("alone"))
    while alone.has_work():
        alone.step()
    del alone
    reference = outputs.pop("alone")
    reference_logprobs = logprobs.pop("alone")

    jobs: list[tuple[str, list[int], SamplingParams]] = [(f"t{i}", prompt, greedy) for i in range(trials)]
    for i in range(trials):
        noise = [rng.randrange(vocab) for _ in range(rng.randint(1, MAX_NOISE_PROMPT))]
        jobs.append((f"b{i}", noise, SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 48))))
    rng.shuffle(jobs)
    step_of.clear()
    engine = _engine(
        model,
        kernels,
        num_blocks=64 * -(-(MAX_NOISE_PROMPT + 64) // PAGE),
        on_step=lambda st: (
            step_tokens.append(st.prefill_tokens + st.decode_tokens),
            step_seconds.append(st.seconds),
        ),
        graphs=graphs,
    )
    started, steps = time.perf_counter(), 0
    while jobs or engine.has_work():
        if time.perf_counter() - started > budget_s:
            jobs = []  # out of time: finish what is in flight, report how many trials ran
        for _ in range(rng.randint(0, ARRIVALS_MAX)):
            if jobs and engine.queue_depth < QUEUE_MAX:
                rid, ids, params = jobs.pop()
                engine.submit(rid, ids, params, sink_for(rid))
        engine.step()
        steps += 1
    graphs = engine._graphs
    completions = [tuple(v) for k, v in outputs.items() if k.startswith("t")]
    ref = tuple(reference)
    firsts = [
        next((i for i, (a, b) in enumerate(zip(c, ref, strict=True)) if a != b), None) for c in completions
    ]
    diverged = [f for f in firsts if f is not None]
    sizes = [batches[k] for k in outputs if k.startswith("t")]
    # Logprobs (the chosen token's and the top 5) are compared as float64 values, which compares their bits: a
    # change in the logits that leaves the argmax alone still shows here.
    bits = [tuple(v) for k, v in logprobs.items() if k.startswith("t")]
    return {
        "trials": len(completions),
        "distinct_completions": len(Counter(completions)),
        "trials_differing_from_alone": len(diverged),
        "distinct_logprob_sequences": len(Counter(bits)),
        "trials_with_logprobs_differing_from_alone": sum(b != tuple(reference_logprobs) for b in bits),
        "first_divergent_position": min(diverged) if diverged else None,
        "median_divergent_position": sorted(diverged)[len(diverged) // 2] if diverged else None,
        "batch_sizes_seen": [min(s[0] for s in sizes), max(s[1] for s in sizes)] if sizes else None,
        "steps": steps,
        "step_graphs": None
        if graphs is None
        else {
            "captures": graphs.captures,
            "shapes": len(graphs.shapes),
            "padded_tokens": graphs.padded_tokens,
            "steps": graphs.steps,
        },
        "step_tokens_median_max": [sorted(step_tokens)[len(step_tokens) // 2], max(step_tokens)]
        if step_tokens
        else None,
        # A target's rows meet the matmuls' M in every step it takes part in (its first token: its prefill step).
        "trials_in_a_step_of_113_or_more_tokens": sum(
            any(step_tokens[i] >= 113 for i in v) for k, v in step_of.items() if k.startswith("t")
        ),
        "max_step_tokens": STEP_TOKENS,
        "max_background_prompt": MAX_NOISE_PROMPT,
        "seconds": time.perf_counter() - started,
        "step_seconds_median": sorted(step_seconds)[len(step_seconds) // 2] if step_seconds else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where to write the JSON report")
    parser.add_argument("--embed-std", type=float, default=1.0, help="std of the random embeddings")
    parser.add_argument("--trials", type=int, default=1000, help="divergence trials per mode")
    parser.add_argument("--budget-s", type=float, default=200.0, help="divergence time limit per mode")
    parser.add_argument("--parts", default="speed,divergence", help="speed, divergence, or both")
    parser.add_argument(
        "--matmul-plans", default="auto", help="the invariant matmuls' plan file: auto, none or a path"
    )
    parser.add_argument(
        "--modes", default="default,batch_invariant", help="kernel modes for the divergence part"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    import triton

    config = qwen3_1_7b()
    plans = args.matmul_plans if args.matmul_plans in ("auto", "none") else Path(args.matmul_plans)
    plan_file = plan_file_for(running_on(torch.device(DEVICE)), set(matmul_shapes(config).values()), plans)
    modes = {mode: select_kernels(mode, torch.device(DEVICE), matmul_plans=plan_file) for mode in MODES}
    weights = random_weights(config, seed=0, embed_std=args.embed_std)
    models = {
        name: Transformer(config, dict(weights), k, torch.device(DEVICE), torch.bfloat16)
        for name, k in modes.items()
    }
    del weights
    compile_plans(modes["batch_invariant"], config)
    props = torch.cuda.get_device_properties(0)
    report: dict[str, Any] = {
        "device": props.name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "model": "Qwen3-1.7B shape, random seeded bf16 weights (seed 0), tied embeddings",
        "matmul_plans": None if plan_file is None else plan_file.described(),
        "embed_std": args.embed_std,
        "context_tokens": CONTEXT,
    }
    if "speed" in parts:
        report.update(speed(models, config))
    if "divergence" in parts:
        report["divergence"] = {}
        for name, model in models.items():
            if name not in args.modes.split(","):
                continue
            report["divergence"][name] = divergence(
                model, modes[name], args.trials, seed=7, budget_s=args.budget_s
            )
            print("divergence", name, json.dumps(report["divergence"][name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)


def speed(models: dict[str, Transformer], config: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"copy_TBps": copy_bandwidth(), "weight_bytes": weight_bytes(models["default"])}
    out["bandwidth_floor_ms"] = out["weight_bytes"] / out["copy_TBps"] / 1e9
    print(f"copy {out['copy_TBps']:.2f} TB/s, floor {out['bandwidth_floor_ms']:.3f} ms", flush=True)
    out["matmul"] = matmul_table(models["batch_invariant"])
    print("matmul done", flush=True)
    cache = PagedKVCache(config, 128 * 37 + 16, PAGE, torch.device(DEVICE), torch.bfloat16)
    out["decode_step_profile_batch1"] = {name: step_profile(model, cache) for name, model in models.items()}
    print("profile", json.dumps(out["decode_step_profile_batch1"]), flush=True)
    for phase, fn in (("decode", decode_rate), ("prefill", prefill_rate)):
        out[phase] = {}
        for batch in BATCHES:
            row = {name: fn(model, cache, batch) for name, model in models.items()}
            row["ratio"] = row["batch_invariant"]["tokens_per_s"] / row["default"]["tokens_per_s"]
            if phase == "prefill":
                row["eager_ratio"] = (
                    row["batch_invariant"]["eager_tokens_per_s"] / row["default"]["eager_tokens_per_s"]
                )
            out[phase][str(batch)] = row
            print(phase, batch, json.dumps(row), flush=True)
    # What dependent launch buys: the batch-1 step again with every kernel launched after the previous one ends.
    launches = [model.kernels.launches for model in models.values()]  # type: ignore[attr-defined]
    for launch in launches:
        launch.dependent_launch = False
    try:
        out["decode_batch1_without_dependent_launch"] = {
            name: decode_rate(model, cache, 1) for name, model in models.items()
        }
    finally:
        for launch in launches:
            launch.dependent_launch = True
    print("without dependent launch", json.dumps(out["decode_batch1_without_dependent_launch"]), flush=True)
    del cache
    torch.cuda.empty_cache()
    return out


def compile_plans(kernels: Kernels, config: ModelConfig) -> None:
    """Every tile the invariant matmuls will launch, compiled at once in processes of their own."""
    assert isinstance(kernels, TritonKernels)
    capability = torch.cuda.get_device_capability()
    plans = {shape: kernels.plans.plan(*shape, capability) for shape in set(matmul_shapes(config).values())}
    jobs = {
        shape: (plan.split_k, list(dict.fromkeys(t for _, t in plan.tiles))) for shape, plan in plans.items()
    }
    compile_ahead(jobs, default_workers(), deadline=time.monotonic() + 120)


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['device']}  torch {r['torch']}  triton {r['triton']}  matmul plans {r['matmul_plans']}")
    for name, d in r.get("divergence", {}).items():
        print(
            f"divergence {name}: {d['trials']} trials, {d['distinct_completions']} distinct completions, "
            f"{d['distinct_logprob_sequences']} distinct logprob sequences, {d['trials_differing_from_alone']} "
            f"differ from alone, first at {d['first_divergent_position']}"
        )
    if "matmul" not in r:
        return
    print(f"copy {r['copy_TBps']:.2f} TB/s")
    worst: dict[str, float] = {}
    for row in r["matmul"]:
        worst[row["weight"]] = max(worst.get(row["weight"], 0.0), row["ratio"])
    print(
        "matmul worst ratio to cuBLAS over M=1..512: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items())
    )
    print(
        "graphs: every step one CUDA graph replay; eager: prefill launched from Python (default, invariant)"
    )
    print(
        "batch  decode tok/s default  invariant  ratio | prefill tok/s default  invariant  ratio | eager ratio"
    )
    for b in BATCHES:
        d, p = r["decode"][str(b)], r["prefill"][str(b)]
        print(
            f"{b:5d}  {d['default']['tokens_per_s']:12.0f}  {d['batch_invariant']['tokens_per_s']:9.0f}  "
            f"{d['ratio']:5.2f} | {p['default']['tokens_per_s']:13.0f}  {p['batch_invariant']['tokens_per_s']:9.0f}"
            f"  {p['ratio']:5.2f} | {p.get('eager_ratio', float('nan')):5.2f} ("
            f"{p['default'].get('eager_tokens_per_s', 0):.0f}, {p['batch_invariant'].get('eager_tokens_per_s', 0):.0f})"
        )
    step = r["decode"]["1"]["batch_invariant"]["step_ms"]
    print(
        f"decode step at batch 1: {step:.3f} ms, floor {r['bandwidth_floor_ms']:.3f} ms, x{step / r['bandwidth_floor_ms']:.2f}"
    )
    plain = r.get("decode_batch1_without_dependent_launch", {}).get("batch_invariant")
    if plain:
        print(f"decode step at batch 1 without dependent launch: {plain['step_ms']:.3f} ms")


if __name__ == "__main__":
    main()
