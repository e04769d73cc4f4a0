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


def padded_rows(packed: torch.Tensor, rows: int) -> tuple[int, ...]:
    """For each count m = 0 .. `rows` of x's rows, the fewest rows m' >= m whose product through a weight packed as
    `packed` (its shape and dtype, for `rows` rows) gives each row the bits that a product of `rows` rows gives it,
    on this CPU and thread count: m rows padded with zero rows to m' have their bits.

    oneDNN picks its kernel from the shapes, and a kernel that blocks K otherwise for fewer rows sums in another
    order (one row often goes through a matrix-vector kernel of its own). Two inputs bring any such difference out:
    random rows, and rows whose sums cancel exactly (the weight's second half of K repeats its first, the row's
    second half negates it), so that what is left is rounding residue alone, which a bfloat16 result keeps: the
    residue of another order of summation differs in its leading bits."""
    k = packed.shape[1]
    generator = torch.Generator().manual_seed(0)
    probe, half = _probe_weight(packed, rows, generator)
    x = torch.randn(2 * rows, k, generator=generator).to(packed.dtype)
    x[rows:, half : 2 * half] = -x[rows:, :half]
    inputs = (x[:rows], x[rows:])
    full = [linear(each, probe) for each in inputs]
    same = [
        all(torch.equal(linear(each[:m], probe), whole[:m]) for each, whole in zip(inputs, full, strict=True))
        for m in range(rows)
    ] + [True]
    return tuple(next(p for p in range(max(m, 1), rows + 1) if same[p]) if m else 0 for m in range(rows + 1))


def wide_blocks(packed: torch.Tensor, rows: int, candidates: tuple[int, ...]) -> tuple[int, ...]:
    """Of `candidates` (multiples of `rows`), each count of x's rows whose one product through a weight packed as
    `packed` gives every row the bits that products of `rows` rows give it, on this CPU and thread count, largest
    first. A step of many rows is then multiplied in a few wide calls that read the weight once each, rather than one
    call per `rows` rows that reads it again every time. Tested as `padded_rows` tests: random rows, and rows whose
    sums cancel to rounding residue."""
    k = packed.shape[1]
    generator = torch.Generator().manual_seed(1)
    probe, half = _probe_weight(packed, rows, generator)
    proven = []
    for count in sorted(c for c in candidates if c % rows == 0 and c > rows):
        x = torch.randn(count, k, generator=generator).to(packed.dtype)
        cancelling = x.clone()
        cancelling[:, half : 2 * half] = -cancelling[:, :half]
        if all(
            torch.equal(
                linear(each, probe),
                torch.cat([linear(each[i : i + rows], probe) for i in range(0, count, rows)]),
            )
            for each in (x, cancelling)
        ):
            proven.append(count)
    return tuple(sorted(proven, reverse=True))


def _probe_weight(packed: torch.Tensor, rows: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """A random weight of `packed`'s shape and dtype whose second half of K repeats its first, packed for `rows` rows;
    and that half's length, so that a row negating its first half in its second sums to rounding residue alone."""
    n, k = packed.shape
    half = k // 2
    w = torch.randn(n, k, generator=generator).to(packed.dtype)
    w[:, half : 2 * half] = w[:, :half]
    return pack(w, rows), half


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ packed.T -> [M, N], in x's dtype (which must be the packed weight's)."""
    if x.shape[0] == 0:
        return x.new_empty(0, packed.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
