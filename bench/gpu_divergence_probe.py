"""A deterministic probe of batch dependence on one GPU, beside the random-load experiment of gpu_price.py.

One 32-token greedy request is run through the Qwen3-1.7B-shaped model (random seeded weights) twice per mode:
alone, and sharing every step with a neighbour (a long prompt prefilled in the same step, then decoding beside
it). Its logits are compared bit for bit at each step. Separately, row 0 of the down projection through cuBLAS
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


def run(model: Transformer, prompt: torch.Tensor, neighbour: torch.Tensor | None) -> list[torch.Tensor]:
    """The request's logits at its prefill and at each of STEPS greedy decode steps."""
    dev = prompt.device
    cache = PagedKVCache(model.config, 256, PAGE, dev, torch.bfloat16)
    tables = torch.arange(256, dtype=torch.int32, device=dev).view(2, 128)
    n = 0 if neighbour is None else len(neighbour)
    tokens = prompt if neighbour is None else torch.cat([neighbour, prompt])
    seq = torch.cat([torch.ones(n, dtype=torch.int32), torch.zeros(len(prompt), dtype=torch.int32)]).to(dev)
    pos = torch.cat([torch.arange(n), torch.arange(len(prompt))]).to(dtype=torch.int32, device=dev)
    rows = torch.tensor([len(tokens) - 1] if neighbour is None else [n - 1, len(tokens) - 1], device=dev)
    out = []
    for step in range(STEPS + 1):
        logits = model.forward(tokens, seq, pos, tables, cache, rows)
        out.append(logits[-1].clone())
        nxt = logits.argmax(-1)
        if neighbour is None:
            tokens, seq, pos = (
                nxt,
                seq[-1:],
                torch.tensor([len(prompt) + step], dtype=torch.int32, device=dev),
            )
        else:
            tokens = nxt
            seq = torch.tensor([1, 0], dtype=torch.int32, device=dev)
            pos = torch.tensor([n + step, len(prompt) + step], dtype=torch.int32, device=dev)
        rows = torch.arange(len(tokens), device=dev)
    return out


def main() -> None:
    config = qwen3_1_7b()
    weights = random_weights(config, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(3)
    prompt = torch.randint(config.vocab_size, (32,), device="cuda", generator=gen)
    neighbour = torch.randint(config.vocab_size, (1500,), device="cuda", generator=gen)
    report: dict[str, Any] = {}
    for name, kernels in (("default", CublasKernels()), ("batch_invariant", TritonKernels(256))):
        model = Transformer(config, dict(weights), kernels, torch.device("cuda"), torch.bfloat16)
        alone, beside = run(model, prompt, None), run(model, prompt, neighbour)
        report[name] = {
            "logits_equal_per_step": [bool(torch.equal(a, b)) for a, b in zip(alone, beside, strict=True)],
            "max_abs_logit_diff_per_step": [
                float((a.float() - b.float()).abs().max()) for a, b in zip(alone, beside, strict=True)
            ],
            "argmax_equal_per_step": [
                bool(a.argmax() == b.argmax()) for a, b in zip(alone, beside, strict=True)
            ],
        }
        down = model.layers[0].down
        print(name, json.dumps(report[name]), flush=True)
    x = torch.randn(2048, down.shape[1], device="cuda", dtype=torch.bfloat16)
    first = F.linear(x[:1], down)[0]
    report["cublas_down_row0_equal_to_M1"] = {
        m: bool(torch.equal(F.linear(x[:m], down)[0], first))
        for m in (1, 2, 32, 64, 113, 128, 209, 512, 1532, 2048)
    }
    print(json.dumps(report["cublas_down_row0_equal_to_M1"]))
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
