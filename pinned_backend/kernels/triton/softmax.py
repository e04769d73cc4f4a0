"""Batch-invariant log-softmax over the last dimension on the GPU, fp32 out, whatever the input float dtype.

One program owns one row and walks it in fixed blocks three times (max, sum of exponentials, write), so the
reduction order depends on the row length alone. The vocabulary (151936 for Qwen3) is far wider than one block;
each pass keeps a per-lane accumulator across blocks and reduces the lanes once at the end, in a tree fixed by the
block width.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent

_BLOCK = 4096


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    start_as_dependent(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    lanes = tl.arange(0, BLOCK)

    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + lanes, mask=start + lanes < V, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, axis=0)

    lane_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + lanes, mask=start + lanes < V, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(x - row_max)
    log_z = row_max + tl.log(tl.sum(lane_sum, axis=0))

    for start in range(0, V, BLOCK):
        mask = start + lanes < V
        x = tl.load(x_row + start + lanes, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + start + lanes, x - log_z, mask=mask)


def log_softmax(x: torch.Tensor, *, dependent: bool = True) -> torch.Tensor:
    """x [M, V] -> [M, V] float32, log-softmax of each row."""
    if x.dim() != 2:
        raise ValueError(f"log_softmax takes 2-D input, got {x.dim()}-D")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, v = x.shape
    out = torch.empty((m, v), device=x.device, dtype=torch.float32)
    if m == 0:
        return out
    options = launch_options(x.device, dependent)
    _log_softmax_kernel[(m,)](x, out, v, x.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=8, **options)
    return out
