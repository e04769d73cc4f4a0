"""SwiGLU's and GeGLU's elementwise half on the GPU: `gate_up [T, 2I] -> act(gate) * up [T, I]`, in one pass, act
SiLU or GELU's tanh approximation (Gemma).

No element depends on another, so invariance is a matter of doing the same arithmetic on each: a program owns
`_BLOCK` columns of one row, and the block and warps are fixed, whatever T. The roundings are the composed
version's (`kernels.unfused.silu`, `gelu_tanh`): the activation in fp32 (silu as g / (1 + exp(-g)); GELU as
0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh as 1 - 2 / (exp(2y) + 1)), rounded to the dtype, then times up
and rounded again. Triton's exp and division are not the C library's, so an element may differ from torch's in its
last bit; the same element always gets the same bits.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent

_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _gated_kernel(
    gate_up_ptr,
    out_ptr,
    inner,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate_row = gate_up_ptr + row * stride_in
    gate = tl.load(gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner_arg = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
        act = (0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner_arg) + 1.0))).to(out_ptr.dtype.element_ty)
    else:
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    y = act.to(tl.float32) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, *, dependent: bool = True) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I] in gate_up's dtype."""
    return _gated(gate_up, gelu=False, dependent=dependent)


def gelu_mul(gate_up: torch.Tensor, *, dependent: bool = True) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> gelu_tanh(gate) * up [T, I] in gate_up's dtype."""
    return _gated(gate_up, gelu=True, dependent=dependent)


def _gated(gate_up: torch.Tensor, *, gelu: bool, dependent: bool) -> torch.Tensor:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 != 0:
        raise ValueError(f"a gated activation takes [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    t, width = gate_up.shape
    inner = width // 2
    out = torch.empty((t, inner), device=gate_up.device, dtype=gate_up.dtype)
    if t == 0 or inner == 0:
        return out
    options = launch_options(gate_up.device, dependent)
    grid = (t, -(-inner // _BLOCK))
    _gated_kernel[grid](
        gate_up,
        out,
        inner,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=_BLOCK,
        GELU=gelu,
        **options,
        num_warps=_NUM_WARPS,
    )
    return out
