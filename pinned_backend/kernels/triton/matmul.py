"""Batch-invariant matmul `x [M, K] @ w[N, K].T -> [M, N]` on the GPU, bf16 or fp16 in, fp32 accumulation.

The launch configuration (tile shape, K step, split of K, warps, pipeline depth) is a function of the weight's
shape (N, K) alone: `matmul_config(n, k)`. The number of rows M only changes how many row tiles are launched, and
each row of a tile is reduced by the same sequence of tensor-core steps whatever its neighbours, so a row's output
bits depend on nothing but that row and the weight. K is cut into `split_k` equal slices summed by separate
programs into fp32 partials, which a second kernel adds in slice order 0, 1, 2, ...; the split is fixed per (N, K),
which buys parallelism at decode sizes without letting M into the reduction order.

The table `TUNED` holds the configurations measured best (worst ratio to cuBLAS over M = 1..512) for the shapes of
the models we serve; other shapes get `rule_config`. This module knows nothing of models or of scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._compat import tl, triton

# Without a split, fewer programs than this leave multiprocessors idle at decode sizes (an H200 has 132).
_TARGET_PROGRAMS = 128
# Each slice of K keeps at least this many elements, so partial sums stay few and long.
_MIN_K_PER_SPLIT = 512


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# (N, K) -> configuration for Qwen3-1.7B's weights, from bench/gpu_kernels.py on an H200 (bench/results/): among
# the configurations whose worst ratio to cuBLAS over M = 1..512 is within 0.25 of the best, the fastest at
# decode sizes (M <= 128), where a serving step spends its matmul time.
TUNED: dict[tuple[int, int], MatmulConfig] = {
    (4096, 2048): MatmulConfig(64, 128, 64, split_k=1, num_warps=4, num_stages=8),
    (12288, 2048): MatmulConfig(64, 128, 64, split_k=1, num_warps=4, num_stages=4),
    (2048, 2048): MatmulConfig(64, 64, 64, split_k=1, num_warps=4, num_stages=6),
    (2048, 6144): MatmulConfig(64, 128, 64, split_k=4, num_warps=4, num_stages=4),
    (151936, 2048): MatmulConfig(64, 128, 64, split_k=1, num_warps=4, num_stages=4),
}


def rule_config(n: int, k: int) -> MatmulConfig:
    """A configuration for any (N, K): wide tiles for wide weights, and a split of K when N alone gives too few
    programs to fill the chip."""
    block_n = 128 if n >= 8192 else 64
    block_k = 64
    tiles_n = -(-n // block_n)
    split_k = 1
    while (
        tiles_n * split_k < _TARGET_PROGRAMS
        and k % (2 * split_k * block_k) == 0
        and k // (2 * split_k) >= _MIN_K_PER_SPLIT
    ):
        split_k *= 2
    return MatmulConfig(
        block_m=64, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=4
    )


def matmul_config(n: int, k: int) -> MatmulConfig:
    """The one configuration used for a weight of shape (N, K), whatever the number of rows."""
    return TUNED.get((n, k)) or rule_config(n, k)


# M is not specialised (Triton would otherwise compile M == 1 and M % 16 == 0 apart): one binary for all M.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # Row tiles vary fastest, so the programs in flight share one weight tile through L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    pid_k = tl.program_id(1)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M are masked, so they cost no memory traffic (re-reading a valid row instead made the 63 idle
    # rows of an M = 1 tile hit one address and ran 1.5x slower); columns past N re-read a valid column, and
    # the store drops them. Each row's result depends on its own inputs only, either way.
    row_ok = (offs_m < M)[:, None]
    cols = offs_n % N
    k_lo = pid_k * K_PER_SPLIT
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + (k_lo + offs_k)[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = ((k_lo + k + offs_k) < K)[None, :]
            x = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0)
            w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    out_ptrs = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    # Slice order 0, 1, 2, ...: the one place partial sums meet, so this order is the reduction order.
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def matmul(x: torch.Tensor, w: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype. `config` is for benchmarks that compare configurations; it
    must not be chosen from M."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"matmul takes bf16 or fp16 operands of one dtype, got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n, k_w = w.shape
    if k != k_w:
        raise ValueError(f"matmul: x has K={k} but w has K={k_w}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    cfg = config or matmul_config(n, k)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    k_per_split = -(-k // cfg.split_k)
    k_per_split = -(-k_per_split // cfg.block_k) * cfg.block_k
    even_k = k_per_split * cfg.split_k == k
    target = (
        out if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), device=x.device, dtype=torch.float32)
    )
    grid = (-(-m // cfg.block_m) * -(-n // cfg.block_n), cfg.split_k)
    _matmul_kernel[grid](
        x,
        w,
        target,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        w.stride(0),
        n,
        m * n,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_K=even_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.split_k > 1:
        block = 1024
        _sum_splits_kernel[(-(-(m * n) // block),)](
            target, out, m * n, SPLIT_K=cfg.split_k, BLOCK=block, num_warps=4
        )
    return out
