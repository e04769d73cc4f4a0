"""Grouped expert matmul on the GPU: each expert's rows of `x [R, K]` times that expert's `w[e] [N, K]`, one launch.

The step's token rows arrive gathered by expert (expert 0's rows first), `offsets [E + 1]` marking where each
expert's run begins and ends. The launch cuts every run into blocks of BLOCK_M rows; one program computes one block
against one BLOCK_N tile of its expert's weight, over all of K in steps of BLOCK_K, accumulating in fp32. The tile
is one shape for every expert and every step, so an element's sum is the same chain of `tl.dot`s over K however many
rows its expert got, wherever its row sits in the run, and whatever the other experts got: the rule the dense
matmul keeps (matmul_plans.py), here with one tile for every M, invariant by construction, not tuned for speed.
Rows past a run's end are masked, so a block never reads another expert's rows. The block table (which expert,
which rows) is built on the host from `offsets`. This module knows nothing of routing or of the model.
"""

from __future__ import annotations

import itertools

import torch

from ._compat import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit(do_not_specialize=["R"])
def _expert_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    block_expert_ptr,
    block_start_ptr,
    block_end_ptr,
    R,
    N,
    K,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    start = tl.load(block_start_ptr + pid_b)
    end = tl.load(block_end_ptr + pid_b)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = (offs_m < end)[:, None]
    # Columns past N re-read a valid column, and the store drops them.
    cols = offs_n % N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):
        k_ok = ((kk + offs_k) < K)[None, :]
        x = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok & (offs_n < N)[None, :])


def expert_blocks(offsets: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Each block's expert, first row and end row: every expert's run of rows cut into blocks of BLOCK_M."""
    experts, starts, ends = [], [], []
    for e in range(len(offsets) - 1):
        for start in range(offsets[e], offsets[e + 1], BLOCK_M):
            experts.append(e)
            starts.append(start)
            ends.append(offsets[e + 1])
    return experts, starts, ends


def expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [R, K] (rows gathered by expert), w [E, N, K], offsets [E + 1] -> [R, N] in x's dtype."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"expert_matmul needs x [R, K] and w [E, N, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"offsets must be [experts + 1] = [{w.shape[0] + 1}]; got {tuple(offsets.shape)}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"offsets must rise from 0 to the {x.shape[0]} rows of x; got {bounds}")
    x, w = x.contiguous(), w.contiguous()
    out = x.new_empty(x.shape[0], w.shape[1])
    experts, starts, ends = expert_blocks(bounds)
    if not experts:
        return out
    table = torch.tensor([experts, starts, ends], dtype=torch.int32, device=x.device)
    grid = (len(experts), triton.cdiv(w.shape[1], BLOCK_N))
    _expert_matmul_kernel[grid](
        x, w, out, table[0], table[1], table[2], x.shape[0], w.shape[1], w.shape[2],
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out
