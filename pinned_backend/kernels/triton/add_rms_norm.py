"""Batch-invariant residual add and RMSNorm in one pass on the GPU: `x + delta`, and that sum normalised.

One program owns one row. It adds the row's update in fp32 and rounds the sum once to x's dtype (what torch's add
gives), stores it, then normalises it with `rms_norm.py`'s jitted helpers, over the same block of
next_power_of_two(D) lanes with the same warps for D: the same reduction tree, so the normalised bits are those of
an add followed by `rms_norm` (tests/test_kernels_triton_fused.py holds them to that). The row count reaches the
kernel only as the grid, never as an argument, so no binary is specialised on it. Rows are read through a row
stride, so row windows and gathered rows need no copy.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent
from .rms_norm import norm_warps, normalise_and_weigh, rms_inverse


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    sum_ptr,
    out_ptr,
    stride_x,
    stride_delta,
    stride_sum,
    stride_out,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    delta = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0)
    summed = (x.to(tl.float32) + delta.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
    x = summed.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normalise_and_weigh(x, rms_inverse(x, D, eps), w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, dependent: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, D], delta [M, D], weight [D] -> (x + delta, rms_norm(x + delta)), both [M, D] in x's dtype."""
    if x.dim() != 2 or delta.shape != x.shape:
        raise ValueError(
            f"add_rms_norm: x and delta must be one [M, D] shape, got {tuple(x.shape)} and {tuple(delta.shape)}"
        )
    if delta.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: delta is {delta.dtype}, x is {x.dtype}; the sum keeps x's dtype")
    m, d = x.shape
    if weight.shape != (d,):
        raise ValueError(f"add_rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if x.stride(1) != 1:
        x = x.contiguous()
    if delta.stride(1) != 1:
        delta = delta.contiguous()
    summed = torch.empty((m, d), device=x.device, dtype=x.dtype)
    normed = torch.empty((m, d), device=x.device, dtype=x.dtype)
    if m == 0:
        return summed, normed
    block_d = triton.next_power_of_2(d)
    num_warps = norm_warps(block_d)
    options = launch_options(x.device, dependent)
    _add_rms_norm_kernel[(m,)](
        x,
        delta,
        weight,
        summed,
        normed,
        x.stride(0),
        delta.stride(0),
        summed.stride(0),
        normed.stride(0),
        d,
        eps,
        BLOCK_D=block_d,
        **options,
        num_warps=num_warps,
    )
    return summed, normed
