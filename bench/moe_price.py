"""The price of reproducibility for a mixture-of-experts model on one GPU, measured side by side in one run.

A Qwen3-30B-A3B-shaped model (`bench/models/qwen3-30b-a3b`: 48 layers, hidden 2048, 128 experts, top 8, expert
intermediate 768, 32 query / 4 KV heads of 128, vocabulary 151936, untied embeddings; 30.5B parameters, 61 GB in
bf16) with random seeded bf16 weights made on the GPU as the model takes them (no checkpoint is written or read):
the numbers are about speed and bit-reproducibility, never about answer quality. The model is the project's own
`Transformer` (and, for the divergence experiment, its `Engine`), in two kernel modes sharing one set of weights:

- `batch_invariant`: `TritonKernels`, the experts in the grouped Triton matmul whose tile is one shape for every
  step (pinned_backend/kernels/triton/expert_matmul.py), the dense matmuls on the plan file the backend would take
  (`--matmul-plans`) or the rule;
- `default`: `CublasKernels`, cuBLAS for the dense matmuls and torch's grouped GEMM (`torch._grouped_mm`) for the
  experts; routing, the sum by rank, attention and the fused kernels are the same in both, so the ratio prices the
  matmuls alone. Both replay every step from a CUDA graph.

Measured: decode tokens/s at batch 1, 8, 32, 128 (context 512) in each mode and their ratio; the batch-1 decode
step against its bandwidth floor (the bytes one token reads: attention, router and its 8 experts in every layer,
the norms, the LM head, its embedding row) over the copy bandwidth measured in the same run; one eager batch-1
step's kernels by family; the divergence experiment (bench/gpu_price.py's: one prompt `--trials` times at
temperature 0 amid random load) for dropless routing in both modes and for a capacity factor in batch_invariant
mode (eager, as the backend serves capacity-limited steps).
Usage: python -m bench.moe_price OUT.json [--parts speed,divergence] [--trials 1000] [--budget-s 150]
       [--layers N] [--capacity-factor 1.0] [--batches 1,8,32,128] [--matmul-plans auto|none|FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.gpu_price import CONTEXT, DEVICE, PAGE, copy_bandwidth, decode_rate, divergence, step_profile
from pinned_backend.checkpoint import ModelConfig, expected_shapes, load_config
from pinned_backend.kernels import Kernels, select_kernels
from pinned_backend.kernels.triton import TritonKernels
from pinned_backend.kernels.triton.plan_files import PlanFile, plan_file_for, running_on
from pinned_backend.kernels.triton.tuner import compile_ahead, default_workers
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer, matmul_shapes
from pinned_backend.routing import DROPLESS, ExpertRouting

MODEL = Path(__file__).parent / "models" / "qwen3-30b-a3b"
BATCHES = [1, 8, 32, 128]


class RandomWeights(dict[str, torch.Tensor]):
    """The checkpoint's weights, each made on the GPU when the model takes it (`Transformer` pops every name it
    needs), so that the model's own fused copies are the only ones ever held: matrices with std 1/sqrt(fan_in),
    embeddings std `embed_std`, norms near 1, every tensor from a generator seeded by its name's position."""

    def __init__(self, config: ModelConfig, seed: int, embed_std: float) -> None:
        super().__init__()
        self.shapes = expected_shapes(config)
        self.index = {name: i for i, name in enumerate(self.shapes)}
        self.seed, self.embed_std = seed, embed_std
        self.generator = torch.Generator(device=DEVICE)

    def pop(self, name: str, *default: Any) -> torch.Tensor:  # type: ignore[override]
        shape = self.shapes[name]
        gen = self.generator.manual_seed(self.seed * 1_000_003 + self.index[name])
        if len(shape) == 1:
            t = 1.0 + 0.1 * torch.randn(shape, device=DEVICE, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            t = self.embed_std * torch.randn(shape, device=DEVICE, generator=gen)
        else:
            t = torch.randn(shape, device=DEVICE, generator=gen) / math.sqrt(shape[1])
        return t.to(torch.bfloat16)


def token_bytes(config: ModelConfig) -> dict[str, int]:
    """The weight bytes one decoded token reads, by part: what a batch-1 step cannot avoid reading."""
    c, moe, bf16 = config, config.moe, 2
    assert moe is not None
    layers = c.num_hidden_layers
    expert = 3 * moe.moe_intermediate_size * c.hidden_size  # gate, up, down
    return {
        "attention": layers * bf16 * ((c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size),
        "router": layers * bf16 * moe.num_experts * c.hidden_size,
        "experts": layers * bf16 * moe.num_experts_per_tok * expert,
        "norms": bf16 * (layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size),
        "lm_head": bf16 * c.vocab_size * c.hidden_size,
        "embedding_row": bf16 * c.hidden_size,
    }


def build(config: ModelConfig, embed_std: float, plan_file: PlanFile | None = None) -> dict[str, Transformer]:
    """One model per mode, sharing one set of weights (the modes differ only in the kernels they call); the
    invariant dense matmuls take `plan_file`'s plans where it holds their shapes."""
    invariant = select_kernels("batch_invariant", torch.device(DEVICE), matmul_plans=plan_file)
    started = time.perf_counter()
    model = Transformer(
        config,
        RandomWeights(config, seed=0, embed_std=embed_std),
        invariant,
        torch.device(DEVICE),
        torch.bfloat16,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(
        f"weights made in {time.perf_counter() - started:.1f} s, "
        f"{torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else 0:.1f} GB on the GPU",
        flush=True,
    )
    default = copy.copy(model)
    default.kernels = select_kernels("default", torch.device(DEVICE))
    return {"default": default, "batch_invariant": model}


def compile_matmuls(kernels: Kernels, config: ModelConfig) -> None:
    """Every dense matmul tile the invariant model launches (attention, router, LM head), compiled at once."""
    assert isinstance(kernels, TritonKernels) and config.moe is not None
    capability = torch.cuda.get_device_capability()
    shapes = set(matmul_shapes(config).values())
    plans = {shape: kernels.plans.plan(*shape, capability) for shape in shapes}
    jobs = {s: (p.split_k, list(dict.fromkeys(t for _, t in p.tiles))) for s, p in plans.items()}
    compile_ahead(jobs, default_workers(), deadline=time.monotonic() + 120)


def speed(models: dict[str, Transformer], config: ModelConfig, batches: list[int]) -> dict[str, Any]:
    parts = token_bytes(config)
    out: dict[str, Any] = {"copy_TBps": copy_bandwidth(), "token_bytes": parts}
    out["token_bytes_total"] = sum(parts.values())
    out["bandwidth_floor_ms"] = out["token_bytes_total"] / out["copy_TBps"] / 1e9
    print(f"copy {out['copy_TBps']:.2f} TB/s, floor {out['bandwidth_floor_ms']:.3f} ms", flush=True)
    blocks = max(batches) * -(-(CONTEXT + 64 + 4) // PAGE) + 16
    cache = PagedKVCache(config, blocks, PAGE, torch.device(DEVICE), torch.bfloat16)
    out["decode_step_profile_batch1"] = {name: step_profile(model, cache) for name, model in models.items()}
    print("profile", json.dumps(out["decode_step_profile_batch1"]), flush=True)
    out["decode"] = {}
    for batch in batches:
        row: dict[str, Any] = {name: decode_rate(model, cache, batch) for name, model in models.items()}
        row["ratio"] = row["batch_invariant"]["tokens_per_s"] / row["default"]["tokens_per_s"]
        out["decode"][str(batch)] = row
        print("decode", batch, json.dumps(row), flush=True)
    del cache
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON report")
    parser.add_argument("--parts", default="speed,divergence", help="speed, divergence, or both")
    parser.add_argument("--trials", type=int, default=1000, help="divergence trials per routing")
    parser.add_argument("--budget-s", type=float, default=150.0, help="divergence time limit per routing")
    parser.add_argument("--embed-std", type=float, default=0.02, help="std of the random embeddings")
    parser.add_argument("--capacity-factor", type=float, default=1.0, help="the capacity-limited routing's F")
    parser.add_argument(
        "--layers", type=int, default=None, help="fewer layers than the model's (a smoke run)"
    )
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes")
    parser.add_argument(
        "--matmul-plans", default="auto", help="the invariant dense matmuls' plan file: auto, none or a path"
    )
    parser.add_argument(
        "--routings",
        default="dropless_default,dropless_invariant,capacity_invariant",
        help="the divergence experiment's legs",
    )
    args = parser.parse_args()
    import triton

    config = load_config(MODEL)
    if args.layers is not None:
        assert config.moe is not None
        sparse = frozenset(i for i in config.moe.sparse_layers if i < args.layers)
        config = replace(config, num_hidden_layers=args.layers, moe=replace(config.moe, sparse_layers=sparse))
    plans = args.matmul_plans if args.matmul_plans in ("auto", "none") else Path(args.matmul_plans)
    plan_file = plan_file_for(running_on(torch.device(DEVICE)), set(matmul_shapes(config).values()), plans)
    models = build(config, args.embed_std, plan_file)
    compile_matmuls(models["batch_invariant"].kernels, config)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "model": f"Qwen3-30B-A3B shape ({config.num_hidden_layers} layers), random seeded bf16 weights (seed 0)",
        "parameters": sum(math.prod(s) for s in expected_shapes(config).values()),
        "matmul_plans": None if plan_file is None else plan_file.described(),
        "embed_std": args.embed_std,
        "context_tokens": CONTEXT,
    }
    parts = set(args.parts.split(","))
    if "speed" in parts:
        report.update(speed(models, config, [int(b) for b in args.batches.split(",")]))
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    if "divergence" in parts:
        capacity = ExpertRouting(args.capacity_factor, "pass_through")
        legs = {
            # (model, graphs): dropless steps replay graphs in both modes, capacity-limited ones run eagerly, as the
            # backend serves them.
            "dropless_default": (models["default"], DROPLESS, True),
            "dropless_invariant": (models["batch_invariant"], DROPLESS, True),
            "capacity_invariant": (models["batch_invariant"], capacity, False),
        }
        report["divergence"] = {}
        for name in args.routings.split(","):
            base, routing, graphs = legs[name]
            model = copy.copy(base)
            model.routing = routing
            result = divergence(
                model, model.kernels, args.trials, seed=7, budget_s=args.budget_s, graphs=graphs
            )
            report["divergence"][name] = {"routing": routing.describe(), "graphs": graphs, **result}
            print("divergence", name, json.dumps(report["divergence"][name]), flush=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


def print_table(r: dict[str, Any]) -> None:
    print(f"\n{r['device']}  torch {r['torch']}  triton {r['triton']}  {r['model']}")
    for name, d in r.get("divergence", {}).items():
        print(
            f"divergence {name}: {d['trials']} trials, {d['distinct_completions']} distinct completions, "
            f"{d['distinct_logprob_sequences']} distinct logprob sequences, {d['trials_differing_from_alone']} "
            f"differ from alone, first at {d['first_divergent_position']} ({d['seconds']:.0f} s, {d['steps']} steps)"
        )
    if "decode" not in r:
        return
    print(f"copy {r['copy_TBps']:.2f} TB/s, token bytes {r['token_bytes_total'] / 1e9:.3f} GB")
    print("batch  decode tok/s default  invariant  ratio   (every step one CUDA graph replay)")
    for b, d in r["decode"].items():
        print(
            f"{int(b):5d}  {d['default']['tokens_per_s']:12.0f}  {d['batch_invariant']['tokens_per_s']:9.0f}  "
            f"{d['ratio']:5.2f}"
        )
    if "1" in r["decode"]:
        step = r["decode"]["1"]["batch_invariant"]["step_ms"]
        default = r["decode"]["1"]["default"]["step_ms"]
        floor = r["bandwidth_floor_ms"]
        print(
            f"decode step at batch 1: invariant {step:.3f} ms (x{step / floor:.2f}), default {default:.3f} ms "
            f"(x{default / floor:.2f}), floor {floor:.3f} ms"
        )


if __name__ == "__main__":
    main()
