"""Weights packed for oneDNN, the CPU's fast path for `x @ w.T`, as the CPU kernel sets take them.

PyTorch's plain `mm` on the CPU reads a weight in its stored layout, and for the skinny products of decoding (a few
rows of x against a large weight) it reaches about half the memory bandwidth that the same product reaches when
the weight is first reordered into oneDNN's blocked layout (bench/results/engines.md). Reordering once, at load, and
multiplying through oneDNN's linear is what compiled CPU servers do too.

A packed weight is an opaque `torch._mkldnn` tensor: it keeps its shape and dtype, but cannot be sliced or indexed,
so a weight is packed only after the model has cut and fused it, and only where `matmul` is the one reader. What
decides a row's bits is unchanged from plain `mm`: one call of one shape gives each row the same bits wherever it
sits and whatever the other rows hold (tests/test_kernels_cpu.py proves it on the machine it runs on), so the
batch_invariant set still issues the product in blocks of a fixed number of rows.
"""

from __future__ import annotations

import functools

import torch

# What PyTorch's oneDNN can pack here: float32 always, bfloat16 where the CPU has native bf16 dot products (elsewhere
# oneDNN would emulate them, slower than mm). float16 is left to mm.
_PACKABLE = (torch.float32, torch.bfloat16)


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether a weight of `dtype` is packed on this CPU."""
    if dtype not in _PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """`w` [N, K] (nn.Linear layout) reordered for products with `rows` rows of x at a time, or `w` itself where
    nothing is gained (another device or dtype, an empty weight)."""
    if w.device.type != "cpu" or w.numel() == 0 or w.dim() != 2 or not packs(w.dtype):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def is_packed(w: torch.Tensor) -> bool:
    return w.is_mkldnn


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ packed.T -> [M, N], in x's dtype (which must be the packed weight's)."""
    if x.shape[0] == 0:
        return x.new_empty(0, packed.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
