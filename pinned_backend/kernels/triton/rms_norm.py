"""Batch-invariant RMSNorm on the GPU: one program normalises one row, so a row's bits never depend on others.

The sum of squares is one `tl.sum` over a block of next_power_of_two(D) lanes in fp32: its tree is fixed by D.
Rows may be the rows of a 2-D tensor or the (token, head) pairs of a 3-D one (Qwen3's per-head q/k norm), read
through strides so that views of a fused projection need no copy. The rounding follows the Hugging Face reference:
normalise in fp32, round to the input dtype, then multiply by the weight and round again.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent


@triton.jit
def rms_inverse(x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of an fp32 row held in one block: one `tl.sum`, whose tree the block fixes. Every
    kernel that normalises a row calls this, so that one D gives one result however the row got there."""
    var = tl.sum(x * x, axis=0) / D
    return 1.0 / tl.sqrt(var + eps)


@triton.jit
def normalise_and_weigh(x, inv, w, DTYPE: tl.constexpr):
    """The Hugging Face roundings: the fp32 row times `inv` rounded to DTYPE, times the weight in fp32, rounded."""
    normed = (x * inv).to(DTYPE)
    return (normed.to(tl.float32) * w.to(tl.float32)).to(DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    inner,
    stride_x_outer,
    stride_x_inner,
    stride_o_outer,
    stride_o_inner,
    D,
    eps,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    row = tl.program_id(0)
    outer = row // inner
    sub = row % inner
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + outer * stride_x_outer + sub * stride_x_inner + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = normalise_and_weigh(x, rms_inverse(x, D, eps), w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + outer * stride_o_outer + sub * stride_o_inner + cols, y, mask=mask)


def norm_warps(block_d: int) -> int:
    """Warps for a norm over a row of `block_d` lanes. They change the reduction tree, so they follow D alone, never
    M; every kernel that normalises a row (add_rms_norm.py, rope_cache.py) takes them from here, so that one D
    gives one tree."""
    return max(1, min(8, block_d // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, dependent: bool = True) -> torch.Tensor:
    """x [M, D] or [M, H, D] (last dimension contiguous), weight [D] -> same shape as x, x's dtype; launched as
    a programmatic dependent where the device supports it, unless not `dependent` (`launch_options`)."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        x3 = x.unsqueeze(1)
    elif x.dim() == 3:
        x3 = x
    else:
        raise ValueError(f"rms_norm takes 2-D or 3-D input, got {x.dim()}-D")
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    out3 = out.view(x3.shape)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    num_warps = norm_warps(block_d)
    options = launch_options(x.device, dependent)
    _rms_norm_kernel[(rows,)](
        x3,
        weight,
        out3,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        out3.stride(0),
        out3.stride(1),
        d,
        eps,
        BLOCK_D=block_d,
        **options,
        num_warps=num_warps,
    )
    return out
