"""The GPU attention both kernel modes run, side by side with the FlashAttention that torch ships, on one GPU.

`batch_invariant` runs the Triton attention over the paged KV cache (kernels/triton/attention.py); `default` runs
the same kernel for decode steps and FlashAttention over keys gathered from the paged cache for steps that prefill
(kernels/triton/flash_prefill.py). The price of invariance is only honest if `default` is as fast as the fastest
attention a default server would run, so both are timed against `scaled_dot_product_attention` restricted to its
FlashAttention backend, over the same keys and values laid out contiguously (flash alone cannot read a paged
cache, so it gets its best case: no block tables and no gather), with grouped-query heads (`enable_gqa`):

- decode: B sequences of one query each, every one at context L;
- prefill: B sequences of L queries each, causal.

Shapes: Qwen3-1.7B's attention (16 query heads, 8 KV heads, head dim 128) and Qwen3-8B's (32, 8, 128), bf16, block
size 16 and the stack's KV split. Each case is timed in `--rounds` rounds, the two implementations in alternating
order, each a median of CUDA-event timings of `--reps` replays of the call captured as a CUDA graph (as the engine
runs its steps, so that the host's launches are not what is timed); figures are medians over rounds and the ratio is the
median of each round's ratio. Decode rows also give the floor: the KV bytes read at the GPU's memory bandwidth
(`--bandwidth`, TB/s).

Usage (on a GPU machine, from the repository root):
    python -m bench.gpu_attention OUT.json [--rounds 5] [--reps 50] [--bandwidth 4.8]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pinned_backend.kernels import DEFAULT_KV_SPLIT_SIZE, select_kernels
from pinned_backend.stack import detect_hardware, detect_software

MODELS = {"qwen3-1.7b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
MODES = ("batch_invariant", "default")
DECODE = [(1, 512), (1, 4096), (8, 1024), (32, 1024), (32, 4096)]  # (sequences, context)
PREFILL = [(1, 512), (1, 2048), (1, 8192), (4, 1024)]  # (sequences, queries each), causal
BLOCK = 16


def cuda_time(call: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of one call, each timed with CUDA events after a warm-up."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(
    heads: tuple[int, int, int], lengths: list[int], queries: list[int], device: torch.device
) -> tuple[dict[str, Callable[[], Any]], int]:
    """Each mode's paged attention and flash over the same keys, values and queries, as CUDA graphs; and the KV
    bytes one call reads. `queries[s]` of sequence s's last positions ask."""
    n_heads, n_kv, dim = heads
    generator = torch.Generator(device=device).manual_seed(0)
    blocks_each = [-(-n // BLOCK) for n in lengths]
    total = sum(blocks_each)
    k_cache = torch.randn(total, BLOCK, n_kv, dim, device=device, generator=generator, dtype=torch.bfloat16)
    v_cache = torch.randn(total, BLOCK, n_kv, dim, device=device, generator=generator, dtype=torch.bfloat16)
    order = torch.randperm(total, device=device, generator=generator).to(torch.int32)
    tables = torch.zeros(len(lengths), max(blocks_each), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(blocks_each):
        tables[s, :n] = order[used : used + n]
        used += n
    seq = torch.cat([torch.full((t,), s, dtype=torch.int32) for s, t in enumerate(queries)]).to(device)
    pos = torch.cat(
        [torch.arange(n - t, n, dtype=torch.int32) for n, t in zip(lengths, queries, strict=True)]
    )
    pos = pos.to(device)
    q = torch.randn(seq.numel(), n_heads, dim, device=device, generator=generator, dtype=torch.bfloat16)
    scale = dim**-0.5
    step = (q, k_cache, v_cache, tables, seq, pos, scale)
    modes = {
        mode: functools.partial(
            select_kernels(mode, device, kv_split_size=DEFAULT_KV_SPLIT_SIZE).attention, *step
        )
        for mode in MODES
    }

    # Flash's layout, [B, H, L, D], built once outside the timing: every sequence at one length here.
    length, per = lengths[0], queries[0]
    keys = torch.stack(
        [
            k_cache[tables[s, : blocks_each[s]].long()].reshape(-1, n_kv, dim)[:length]
            for s in range(len(lengths))
        ]
    )
    values = torch.stack(
        [
            v_cache[tables[s, : blocks_each[s]].long()].reshape(-1, n_kv, dim)[:length]
            for s in range(len(lengths))
        ]
    )
    keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    queries_4d = q.reshape(len(lengths), per, n_heads, dim).transpose(1, 2).contiguous()
    causal = per > 1

    def flash() -> Any:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(
                queries_4d, keys, values, is_causal=causal, scale=scale, enable_gqa=True
            )

    # The outputs agree (same maths, other orders): a wrong comparison would time different work.
    for run in modes.values():
        mine = run().reshape(len(lengths), per, n_heads, dim).transpose(1, 2).float()
        torch.testing.assert_close(mine, flash().float(), atol=2e-2, rtol=2e-2)
    kv_bytes = 2 * sum(lengths) * n_kv * dim * 2
    return {**{mode: graphed(run) for mode, run in modes.items()}, "flash": graphed(flash)}, kv_bytes


def graphed(call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` captured as a CUDA graph, as the engine replays its steps: the timing is the GPU's, not the host's
    launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda")
    rows = []
    for model, heads in MODELS.items():
        shapes = [("decode", b, length, [length] * b, [1] * b) for b, length in DECODE]
        shapes += [("prefill", b, length, [length] * b, [length] * b) for b, length in PREFILL]
        for kind, batch, length, lengths, queries in shapes:
            calls, kv_bytes = case(heads, lengths, queries, device)
            rounds = []
            for r in range(args.rounds):
                order = list(calls.items())
                order = order[r % len(order) :] + order[: r % len(order)]
                rounds.append({name: cuda_time(call, args.reps) for name, call in order})
            row: dict[str, Any] = {"model": model, "kind": kind, "sequences": batch, "context": length}
            for name in calls:
                row[f"{name}_ms"] = statistics.median(t[name] for t in rounds)
            for mode in MODES:
                row[f"{mode}_over_flash"] = statistics.median(t[mode] / t["flash"] for t in rounds)
            if kind == "prefill":  # causal: half the score matrix, two GEMMs of 2 * D flops per entry
                flops = 2 * 2 * heads[0] * heads[2] * sum(n * n / 2 for n in lengths)
                row["flash_tflops"] = flops / (row["flash_ms"] * 1e-3) / 1e12
                row["default_tflops"] = flops / (row["default_ms"] * 1e-3) / 1e12
            else:
                row["floor_ms"] = kv_bytes / (args.bandwidth * 1e12) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "command": "python -m bench.gpu_attention OUT.json "
        f"--rounds {args.rounds} --reps {args.reps} --bandwidth {args.bandwidth}",
        "hardware": detect_hardware(device),
        "software": detect_software(device),
        "kv_split_size": DEFAULT_KV_SPLIT_SIZE,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--bandwidth", type=float, default=4.8, help="the GPU's memory bandwidth in TB/s")
    args = parser.parse_args()
    report = measure(args)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
