"""A mixture-of-experts layer's experts on the GPU: the dispatch of a step's tokens to their experts, the grouped
expert matmul, and the sum of a token's k expert outputs by rank; each one launch whose configuration never depends
on the step's routing.

**The dispatch** (`dispatch`): a step's T tokens each chose k experts, so it has A = T * k assignments. One program
lays them out by expert with a counting sort (stable, so within an expert by token and rank), and `offsets [E + 1]`
marks where each expert's run of sorted rows begins and ends; each run is cut into blocks of BLOCK_M rows. All of it
is computed on the GPU, with no read back to the host, so a step of it can be captured in a CUDA graph and replayed
whatever the tokens chose.

**The matmul** (`grouped_matmul`): a grid of every block the step could have (a bound fixed by T, k and E) times the
weight's column tiles. A program finds its block by a binary search over the blocks' running count, computes it
against one BLOCK_N tile of its expert's weight over all of K in steps of BLOCK_K, accumulating in fp32, and a program
past the step's last block returns at once. The tile is one shape for every expert and every step, so an element's
sum is the same chain of `tl.dot`s over K however many rows its expert got, wherever its row sits in the run, and
whatever the other experts got: the rule the dense matmul keeps (matmul_plans.py), here with one tile for every M,
invariant by construction. BLOCK_M is 16 because a decode step gives an expert a few rows at most (a batch of 128
gives each of 128 experts 8 on average): a wider block would read the same weight for rows that are not there.
Rows past a run's end are masked, so a block never reads another expert's rows. The rows of x may be gathered
on the way in (`rows`: the sorted row's token), so the step's tokens are never copied into expert order.

**The combine** (`combine_by_rank`): each token's k outputs, scaled by their routing weights rounded to the
activations' dtype, added in rank order with a rounding after every product and every sum: what the CPU's
`batch_invariant` layer computes with elementwise torch ops (moe.py), in one pass. A refused assignment (capacity
routing) adds nothing.

This module knows nothing of routing or of the model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ._compat import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
_WARPS, _STAGES = 4, 4
COMBINE_BLOCK = 1024  # hidden columns per program of the combine
DISPATCH_CHUNK = 256  # assignments the dispatch places at a time


@dataclass(frozen=True)
class ExpertDispatch:
    """Where each assignment of a step went, all on the step's device. `token [A]`: the token of each sorted row;
    `slot_row [A]`: the sorted row of each assignment (token * k + rank); `offsets [E + 1]`: each expert's run of
    sorted rows (offsets[E] onwards: the refused); `block_ends [E]`: the running count of BLOCK_M blocks, expert by
    expert; `max_blocks`: the most blocks a step of this many assignments can have (the grid)."""

    token: torch.Tensor
    slot_row: torch.Tensor
    offsets: torch.Tensor
    block_ends: torch.Tensor
    max_blocks: int
    top_k: int


def max_blocks(assignments: int, num_experts: int) -> int:
    """The most BLOCK_M blocks `assignments` rows over `num_experts` runs can be cut into."""
    return min(assignments, (assignments + num_experts * (BLOCK_M - 1)) // BLOCK_M)


def dispatch(experts: torch.Tensor, num_experts: int, dropped: int = -1) -> ExpertDispatch:
    """experts [T, k] int64 (each token's experts by rank; `dropped` where refused) -> the step's dispatch, in one
    launch (`_dispatch_kernel`). Refused assignments sort after every expert's run, where no block reaches them."""
    tokens, top_k = experts.shape
    assignments = tokens * top_k
    device = experts.device
    token = torch.empty(assignments, dtype=torch.int64, device=device)
    slot_row = torch.empty(assignments, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    block_ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    if assignments:
        _dispatch_kernel[(1,)](
            experts.contiguous(), token, slot_row, offsets, block_ends, assignments, num_experts,
            TOP_K=top_k, DROPPED=dropped, EXPERTS_BLOCK=triton.next_power_of_2(num_experts),
            CHUNK=DISPATCH_CHUNK, BLOCK_M=BLOCK_M, num_warps=8,
        )  # fmt: skip
    else:
        offsets.zero_()
        block_ends.zero_()
    return ExpertDispatch(
        token=token,
        slot_row=slot_row,
        offsets=offsets,
        block_ends=block_ends,
        max_blocks=max_blocks(assignments, num_experts),
        top_k=top_k,
    )


@triton.jit
def _dispatch_kernel(
    experts_ptr,
    token_ptr,
    slot_row_ptr,
    offsets_ptr,
    block_ends_ptr,
    A,
    E,
    TOP_K: tl.constexpr,
    DROPPED: tl.constexpr,
    EXPERTS_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # A counting sort in one program: count each expert's assignments, lay the runs out, then place every
    # assignment after the earlier ones of its expert (so the sort is stable), chunk by chunk in assignment order.
    lanes = tl.arange(0, CHUNK)
    expert_ids = tl.arange(0, EXPERTS_BLOCK)
    counts = tl.zeros((EXPERTS_BLOCK,), dtype=tl.int32)
    for start in range(0, A, CHUNK):
        a = start + lanes
        key = tl.load(experts_ptr + a, mask=a < A, other=DROPPED)
        counts += tl.sum((key[:, None] == expert_ids[None, :]).to(tl.int32), axis=0)
    starts = tl.cumsum(counts, axis=0) - counts
    kept = tl.sum(counts, axis=0)
    real = expert_ids < E
    tl.store(offsets_ptr + expert_ids, starts, mask=real)
    tl.store(offsets_ptr + E, kept)
    tl.store(block_ends_ptr + expert_ids, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0), mask=real)
    placed = tl.zeros((EXPERTS_BLOCK,), dtype=tl.int32)
    refused = kept * 0
    for start in range(0, A, CHUNK):
        a = start + lanes
        valid = a < A
        key = tl.load(experts_ptr + a, mask=valid, other=DROPPED)
        hits = (key[:, None] == expert_ids[None, :]).to(tl.int32)  # [CHUNK, EXPERTS_BLOCK]
        earlier = tl.cumsum(hits, axis=0) - hits + (starts + placed)[None, :]
        row = tl.sum(hits * earlier, axis=1)
        gone = (valid & (key == DROPPED)).to(tl.int32)
        row = tl.where(key == DROPPED, kept + refused + tl.cumsum(gone, axis=0) - gone, row)
        tl.store(slot_row_ptr + a, row, mask=valid)
        tl.store(token_ptr + row, (a // TOP_K).to(tl.int64), mask=valid)
        placed += tl.sum(hits, axis=0)
        refused += tl.sum(gone, axis=0)


@triton.jit(do_not_specialize=["R"])
def _expert_matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    offsets_ptr,
    block_ends_ptr,
    R,
    N,
    K,
    E,
    stride_xm,
    stride_we,
    stride_wn,
    stride_om,
    GATHER: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    # The block's expert: the first whose running block count passes pid_b (E when the step has fewer blocks).
    lo = pid_b * 0
    hi = lo + E
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        passed = tl.load(block_ends_ptr + tl.minimum(mid, E - 1)) > pid_b
        open_range = lo < hi
        hi = tl.where(open_range & passed, mid, hi)
        lo = tl.where(open_range & (passed == 0), mid + 1, lo)
    if lo >= E:
        return
    expert = lo.to(tl.int64)
    first_block = tl.load(block_ends_ptr + expert) - tl.cdiv(
        tl.load(offsets_ptr + expert + 1) - tl.load(offsets_ptr + expert), BLOCK_M
    )
    start = tl.load(offsets_ptr + expert) + (pid_b - first_block) * BLOCK_M
    end = tl.load(offsets_ptr + expert + 1)
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < end
    if GATHER:  # noqa: SIM108  (a constexpr branch, settled when the kernel compiles)
        x_rows = tl.load(rows_ptr + offs_m, mask=row_ok, other=0).to(tl.int64)
    else:
        x_rows = offs_m.to(tl.int64)
    # Columns past N re-read a valid column, and the store drops them.
    cols = offs_n % N
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, K, BLOCK_K):
        k_ok = ((kk + offs_k) < K)[None, :]
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


def grouped_matmul(
    x: torch.Tensor, w: torch.Tensor, plan: ExpertDispatch, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """x [R, K] (or, with `rows [A]`, the token rows that sorted row i reads), w [E, N, K] -> [A, N] in x's dtype:
    sorted row i is x's row times its expert's weight. Rows no expert computes (refused assignments) are left
    unwritten."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"expert matmuls need x [R, K] and w [E, N, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    assignments = plan.token.shape[0]
    if rows is None and x.shape[0] != assignments:
        raise ValueError(f"x has {x.shape[0]} rows for the dispatch's {assignments} sorted rows")
    x, w = x.contiguous(), w.contiguous()
    out = x.new_empty(assignments, w.shape[1])
    if assignments == 0:
        return out
    experts = w.shape[0]
    grid = (plan.max_blocks, triton.cdiv(w.shape[1], BLOCK_N))
    _expert_matmul_kernel[grid](
        x, w, out, rows if rows is not None else plan.offsets, plan.offsets, plan.block_ends,
        x.shape[0], w.shape[1], w.shape[2], experts, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATHER=rows is not None, SEARCH_STEPS=max(1, experts.bit_length()),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=_WARPS, num_stages=_STAGES,
    )  # fmt: skip
    return out


def expert_matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [R, K] (rows already in expert order), w [E, N, K], offsets [E + 1] -> [R, N] in x's dtype. The offsets are
    checked on the host: this entry is for tests and tools; a served step dispatches with `dispatch`."""
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"expert_matmul needs x [R, K] and w [E, N, K]; got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if offsets.shape != (w.shape[0] + 1,):
        raise ValueError(f"offsets must be [experts + 1] = [{w.shape[0] + 1}]; got {tuple(offsets.shape)}")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"offsets must rise from 0 to the {x.shape[0]} rows of x; got {bounds}")
    counts = [b - a for a, b in itertools.pairwise(bounds)]
    experts = torch.repeat_interleave(torch.arange(w.shape[0]), torch.tensor(counts)).to(x.device)
    return grouped_matmul(x, w, dispatch(experts[:, None], w.shape[0]))


def expert_blocks(offsets: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Each block's expert, first row and end row, as the kernel finds them: every expert's run cut into blocks of
    BLOCK_M."""
    experts, starts, ends = [], [], []
    for e in range(len(offsets) - 1):
        for start in range(offsets[e], offsets[e + 1], BLOCK_M):
            experts.append(e)
            starts.append(start)
            ends.append(offsets[e + 1])
    return experts, starts, ends


@triton.jit
def _combine_kernel(
    y_ptr,
    slot_row_ptr,
    experts_ptr,
    weights_ptr,
    out_ptr,
    H,
    stride_y,
    stride_o,
    TOP_K: tl.constexpr,
    DROPPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < H
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32).to(dtype)
    for r in tl.static_range(TOP_K):
        slot = token * TOP_K + r
        kept = tl.load(experts_ptr + slot) != DROPPED
        row = tl.load(slot_row_ptr + slot).to(tl.int64)
        scale = tl.load(weights_ptr + slot).to(dtype).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + cols, mask=col_ok & kept, other=0.0).to(tl.float32)
        # Rounded as torch rounds `y * scale` and then `acc + that` in the activations' dtype.
        term = (y * scale).to(dtype)
        summed = (acc.to(tl.float32) + term.to(tl.float32)).to(dtype)
        acc = tl.where(kept, summed, acc)
    tl.store(out_ptr + token * stride_o + cols, acc, mask=col_ok)


def combine_by_rank(
    y: torch.Tensor, plan: ExpertDispatch, experts: torch.Tensor, weights: torch.Tensor, dropped: int = -1
) -> torch.Tensor:
    """y [A, H] (sorted rows), experts [T, k], weights [T, k] float32 -> [T, H]: each token's k outputs scaled and
    added in rank order."""
    tokens, top_k = experts.shape
    out = y.new_empty(tokens, y.shape[1])
    if tokens == 0:
        return out
    grid = (tokens, triton.cdiv(y.shape[1], COMBINE_BLOCK))
    _combine_kernel[grid](
        y, plan.slot_row, experts.contiguous(), weights.contiguous(), out, y.shape[1], y.stride(0), out.stride(0),
        TOP_K=top_k, DROPPED=dropped, BLOCK=COMBINE_BLOCK,
    )  # fmt: skip
    return out
