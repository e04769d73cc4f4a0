"""A deterministic probe of batch dependence on one GPU, beside the random-load experiment of gpu_price.py.

One 32-token greedy request is run through the Qwen3-1.7B-shaped model (random seeded weights) per mode: alone,
and sharing every step with a neighbour (a long prompt prefilled in the same step, then decoding beside it), its
tokens placed after the neighbour's and before them. Its logits are compared bit for bit at each step. Separately, row 0 of the down projection through cuBLAS
is compared across M, to show where cuBLAS changes its reduction. Usage: python bench/gpu_divergence_probe.py OUT
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from gpu_price import PAGE, CublasKernels, qwen3_1_7b, random_weights

from pinned_backend.kernels.triton import TritonKernels
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.model import Transformer

STEPS = 8


def run(
    model: Transformer, prompt: torch.Tensor, neighbour: torch.Tensor | None, first: bool
) -> list[torch.Tensor]:
    """The request's logits at its prefill and at each of STEPS greedy decode steps; `first`: its tokens lead
    each step (as an engine that schedules decodes first places them), else they follow the neighbour's."""
    dev = prompt.device
    cache = PagedKVCache(model.config, 256, PAGE, dev, torch.bfloat16)
    tables = torch.arange(256, dtype=torch.int32, device=dev).view(2, 128)
    other = neighbour if neighbour is not None else prompt[:0]
    n, p = len(other), len(prompt)
    seq_t, seq_o = torch.zeros(p, dtype=torch.int32), torch.ones(n, dtype=torch.int32)
    pos_t, pos_o = torch.arange(p, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    parts = [(prompt, seq_t, pos_t), (other, seq_o, pos_o)]
    if not first:
        parts.reverse()
    tokens = torch.cat([t for t, _, _ in parts])
    seq = torch.cat([q for _, q, _ in parts]).to(dev)
    pos = torch.cat([x for _, _, x in parts]).to(dev)
    ends = torch.cumsum(torch.tensor([len(t) for t, _, _ in parts]), 0) - 1
    rows = ends[torch.tensor([len(t) > 0 for t, _, _ in parts])].to(dev)
    mine = 0 if first or n == 0 else 1
    out = []
    for step in range(STEPS + 1):
        logits = model.forward(tokens, seq, pos, tables, cache, rows)
        out.append(logits[mine].clone())
        tokens = logits.argmax(-1)
        order = [(0, p + step), (1, n + step)] if n else [(0, p + step)]
        if not first:
            order.reverse()
        seq = torch.tensor([s for s, _ in order], dtype=torch.int32, device=dev)
        pos = torch.tensor([x for _, x in order], dtype=torch.int32, device=dev)
        rows = torch.arange(len(order), device=dev)
    return out


def compare(alone: list[torch.Tensor], beside: list[torch.Tensor]) -> dict[str, list[Any]]:
    pairs = list(zip(alone, beside, strict=True))
    return {
        "logits_equal_per_step": [bool(torch.equal(a, b)) for a, b in pairs],
        "max_abs_logit_diff_per_step": [float((a.float() - b.float()).abs().max()) for a, b in pairs],
        "argmax_equal_per_step": [bool(a.argmax() == b.argmax()) for a, b in pairs],
    }


def main() -> None:
    config = qwen3_1_7b()
    weights = random_weights(config, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randint(config.vocab_size, (32,), device="cuda", generator=gen)
    neighbour = torch.randint(config.vocab_size, (1500,), device="cuda", generator=gen)
    report: dict[str, Any] = {}
    for name, kernels in (("default", CublasKernels()), ("batch_invariant", TritonKernels(256))):
        model = Transformer(config, dict(weights), kernels, torch.device("cuda"), torch.bfloat16)
        alone = run(model, prompt, None, first=True)
        report[name] = {
            "neighbour_first": compare(alone, run(model, prompt, neighbour, first=False)),
            "request_first": compare(alone, run(model, prompt, neighbour, first=True)),
        }
        down = model.layers[0].down
        print(name, json.dumps(report[name]), flush=True)
    x = torch.randn(2048, down.shape[1], device="cuda", dtype=torch.bfloat16)
    first = F.linear(x[:1], down)[0]
    report["cublas_down_row0_equal_to_M1"] = {
        m: bool(torch.equal(F.linear(x[:m], down)[0], first))
        for m in (1, 2, 32, 64, 113, 128, 209, 512, 1532, 2048)
    }
    report["cublas_down_last_row_equal_to_M1"] = {
        m: bool(torch.equal(F.linear(x[:m], down)[m - 1], F.linear(x[m - 1 : m], down)[0]))
        for m in (1, 2, 32, 64, 113, 128, 209, 512, 1532, 2048)
    }
    print(
        json.dumps(report["cublas_down_row0_equal_to_M1"]),
        json.dumps(report["cublas_down_last_row_equal_to_M1"]),
    )
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
