"""The price of reproducibility for the model families on one GPU: decode throughput in both kernel modes, side by side.

For each model folder given (`bench/models/gemma3-12b`, `gpt-oss-20b`, `deepseek-v3`: config.json files of the real
models' shapes), a model of random seeded bf16 weights made on the GPU as the model takes them (bench/moe_price.py's
`RandomWeights`; no checkpoint is written or read, so the numbers are about speed, never about answer quality), run in
two kernel modes sharing one set of weights: `batch_invariant` (`TritonKernels`) and `default` (`CublasKernels`:
cuBLAS matmuls, torch's grouped GEMM for experts, a batched GEMM per head for latent attention; attention, norms,
routing and the fused kernels the same Triton kernels in both, so the ratio prices the matmuls). A model too large for
the GPU keeps as many layers as fit (`--layers auto`: its dense layers first, then sparse ones while the free memory
allows); the report says how many.

Measured: decode tokens/s at batch 1, 8, 32 and 128 after a prompt of 512 tokens, each step one CUDA graph replay
(bench/gpu_price.py's `decode_rate`), in each mode and their ratio; the batch-1 step against its bandwidth floor: the
bytes one token must read (every dense weight; of each sparse layer, the router, the shared experts and k of its
experts; the LM head; one embedding row) over the copy bandwidth measured in the same run.
Usage: python -m bench.families_price OUT.json --model DIR [--model DIR ...] [--layers auto|N] [--batches 1,8,32,128]
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

from bench.gpu_price import CONTEXT, DECODE_STEPS, DEVICE, PAGE, copy_bandwidth, decode_rate
from bench.moe_price import RandomWeights
from pinned_backend.checkpoint import ModelConfig, expected_shapes, load_config
from pinned_backend.kernels import select_kernels
from pinned_backend.kernels.triton.plan_files import plan_file_for, running_on
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer, matmul_shapes

BATCHES = [1, 8, 32, 128]
RESERVE_BYTES = 24 << 30  # left free for the KV cache, activations and graphs when layers are cut to fit


def token_bytes(config: ModelConfig) -> int:
    """The weight bytes one decoded token reads: each sparse layer's experts count k / E of their bytes, the
    embedding one row (the LM head, tied or not, all of it)."""
    total = 0
    moe = config.moe
    for name, shape in expected_shapes(config).items():
        size = math.prod(shape) * 2
        if moe is not None and ".experts." in name:
            size = size * moe.num_experts_per_tok // moe.num_experts
        if name == "model.embed_tokens.weight":
            size = shape[1] * 2 + (size if config.tie_word_embeddings else 0)
        total += size
    return total


def layer_bytes(config: ModelConfig, layer: int) -> int:
    prefix = f"model.layers.{layer}."
    return sum(math.prod(s) * 2 for n, s in expected_shapes(config).items() if n.startswith(prefix))


def fitted(config: ModelConfig, layers: str) -> ModelConfig:
    """The config with `layers` layers (a number), or as many as fit in the GPU's free memory ("auto")."""
    if layers != "auto":
        count = int(layers)
    else:
        budget = torch.cuda.mem_get_info()[0] - RESERVE_BYTES
        budget -= sum(math.prod(s) * 2 for n, s in expected_shapes(config).items() if "layers." not in n)
        count = 0
        while count < config.num_hidden_layers and budget >= layer_bytes(config, count):
            budget -= layer_bytes(config, count)
            count += 1
    if count >= config.num_hidden_layers:
        return config
    moe = config.moe
    kept = range(count)
    return replace(
        config,
        num_hidden_layers=count,
        sliding_layers=frozenset(i for i in config.sliding_layers if i in kept),
        nope_layers=frozenset(i for i in config.nope_layers if i in kept),
        moe=None
        if moe is None
        else replace(moe, sparse_layers=frozenset(i for i in moe.sparse_layers if i in kept)),
        mla=None if config.mla is None else replace(config.mla, mtp_layers=0),
    )


def measure(folder: Path, layers: str, batches: list[int], copy_tbps: float) -> dict[str, Any]:
    full = load_config(folder)
    config = fitted(full, layers)
    started = time.perf_counter()
    plan_file = plan_file_for(running_on(torch.device(DEVICE)), set(matmul_shapes(config).values()), "auto")
    invariant = select_kernels("batch_invariant", torch.device(DEVICE), matmul_plans=plan_file)
    model = Transformer(
        config, RandomWeights(config, seed=0, embed_std=1.0), invariant, torch.device(DEVICE), torch.bfloat16
    )
    default = copy.copy(model)
    default.kernels = select_kernels("default", torch.device(DEVICE))
    models = {"default": default, "batch_invariant": model}
    floor_ms = token_bytes(config) / copy_tbps / 1e9
    report: dict[str, Any] = {
        "model": folder.name,
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "layers_in_the_model": full.num_hidden_layers,
        "parameters": sum(math.prod(s) for s in expected_shapes(config).values()),
        "token_bytes": token_bytes(config),
        "bandwidth_floor_ms": floor_ms,
        "weights_made_s": time.perf_counter() - started,
        "decode": {},
    }
    print(f"{folder.name}: {config.num_hidden_layers} of {full.num_hidden_layers} layers", flush=True)
    blocks = max(batches) * -(-(CONTEXT + DECODE_STEPS + 4) // PAGE) + 16
    cache = PagedKVCache(config, blocks, PAGE, torch.device(DEVICE), torch.bfloat16)
    for batch in batches:
        row: dict[str, Any] = {name: decode_rate(m, cache, batch) for name, m in models.items()}
        row["ratio"] = row["batch_invariant"]["tokens_per_s"] / row["default"]["tokens_per_s"]
        report["decode"][str(batch)] = row
        print("decode", folder.name, batch, json.dumps(row), flush=True)
    one = report["decode"].get("1")
    if one is not None:
        report["batch1_step_over_floor"] = {name: one[name]["step_ms"] / floor_ms for name in models}
    del cache, models, model, default
    torch.cuda.empty_cache()
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}")
    print(f"copy {report['copy_TBps']:.2f} TB/s, context {report['context_tokens']} tokens")
    print("model          layers  batch  default tok/s  invariant tok/s  ratio")
    for m in report["models"]:
        layers = f"{m['layers']}/{m['layers_in_the_model']}"
        for batch, row in m["decode"].items():
            default, invariant = row["default"]["tokens_per_s"], row["batch_invariant"]["tokens_per_s"]
            print(
                f"{m['model']:14} {layers:>6}  {batch:>5}  {default:13.0f}  {invariant:15.0f}  {row['ratio']:5.2f}"
            )
        over = m.get("batch1_step_over_floor")
        if over is not None:
            print(
                f"{m['model']:14} batch-1 step over its bandwidth floor of {m['bandwidth_floor_ms']:.3f} ms: "
                f"default {over['default']:.2f}x, batch_invariant {over['batch_invariant']:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where to write the JSON report")
    parser.add_argument(
        "--model", type=Path, action="append", required=True, help="a folder with a config.json"
    )
    parser.add_argument("--layers", default="auto", help="layers to keep: auto (as many as fit) or a number")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="decode batch sizes")
    args = parser.parse_args()
    import triton

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "context_tokens": CONTEXT,
        "copy_TBps": copy_bandwidth(),
        "models": [],
    }
    for folder in args.model:
        batches = [int(b) for b in args.batches.split(",")]
        report["models"].append(measure(folder, args.layers, batches, report["copy_TBps"]))
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)


if __name__ == "__main__":
    main()
