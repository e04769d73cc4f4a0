"""From the fused q/k/v projection to attention's inputs in one pass on the GPU: per-head q/k RMSNorm (Qwen3), RoPE,
and the write of this step's keys and values into the paged cache.

One program owns one (token, head) pair of the grid [T, Hq + Hkv]: a query head, or a KV head, whose program
rotates the key and copies the value. Nothing crosses programs, and the block sizes and warps follow the head
dimension alone, so a row's bits never depend on T or on its neighbours; T reaches the kernel only as the grid.
The norm is `rms_norm.py`'s jitted helpers over the whole head row, the same tree for the same D; the rotation reads
the row again as two halves, since a register tensor cannot be permuted (rotate_half), and applies the norm's
per-row scale to each half, which gives every element the bits the whole-row norm would. The roundings are the
composed version's (`kernels.unfused`): the norm rounds to the dtype, then the weight product; the rotation runs
in fp32 on the fp32 tables and rounds once; keys are rounded to the dtype before the cache's dtype, as the unfused
model rounded them. Layouts as in `pinned_backend.kernels`; this module knows nothing of how slots are chosen.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent
from .rms_norm import norm_warps, normalise_and_weigh, rms_inverse


@triton.jit
def _normed_rotated(
    row_ptr,
    w_ptr,
    cos,
    sin,
    D,
    eps,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
):
    """One head row, normalised if NORM, rotated: its two halves in fp32, not yet rounded."""
    half = D // 2
    lanes = tl.arange(0, HALF)
    in_half = lanes < half
    x1 = tl.load(row_ptr + lanes, mask=in_half, other=0.0)
    x2 = tl.load(row_ptr + half + lanes, mask=in_half, other=0.0)
    if NORM:
        cols = tl.arange(0, BLOCK_D)
        x = tl.load(row_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        inv = rms_inverse(x, D, eps)
        w1 = tl.load(w_ptr + lanes, mask=in_half, other=0.0)
        w2 = tl.load(w_ptr + half + lanes, mask=in_half, other=0.0)
        x1 = normalise_and_weigh(x1.to(tl.float32), inv, w1, x1.dtype)
        x2 = normalise_and_weigh(x2.to(tl.float32), inv, w2, x2.dtype)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _qkv_rope_cache_kernel(
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkv,
    stride_rope,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    page,
    D,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM_Q: tl.constexpr,
    NORM_K: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = D // 2
    lanes = tl.arange(0, HALF)
    in_half = lanes < half
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_rope + lanes, mask=in_half, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_rope + lanes, mask=in_half, other=0.0)
    row = qkv_ptr + tok * stride_qkv
    if head < HQ:
        r1, r2 = _normed_rotated(row + head * D, q_norm_ptr, cos, sin, D, eps, HALF, BLOCK_D, NORM_Q)
        dst = q_ptr + tok * stride_qt + head * stride_qh
        tl.store(dst + lanes, r1.to(q_ptr.dtype.element_ty), mask=in_half)
        tl.store(dst + half + lanes, r2.to(q_ptr.dtype.element_ty), mask=in_half)
    else:
        kv_head = head - HQ
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        at = (slot // page) * stride_cb + (slot % page) * stride_cs + kv_head * stride_ch
        r1, r2 = _normed_rotated(
            row + (HQ + kv_head) * D, k_norm_ptr, cos, sin, D, eps, HALF, BLOCK_D, NORM_K
        )
        k_dst = k_cache_ptr + at
        k1 = r1.to(qkv_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
        k2 = r2.to(qkv_ptr.dtype.element_ty).to(k_cache_ptr.dtype.element_ty)
        tl.store(k_dst + lanes, k1, mask=in_half)
        tl.store(k_dst + half + lanes, k2, mask=in_half)
        cols = tl.arange(0, BLOCK_D)
        v = tl.load(row + (HQ + HKV + kv_head) * D + cols, mask=cols < D, other=0.0)
        tl.store(v_cache_ptr + at + cols, v.to(v_cache_ptr.dtype.element_ty), mask=cols < D)


def qkv_rope_cache(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    dependent: bool = True,
) -> torch.Tensor:
    """Normalise and rotate q and k, write k and v at `slots` -> q [T, Hq, D] in qkv's dtype."""
    t, width = qkv.shape
    _, page, hkv, d = k_cache.shape
    q_size = width - 2 * hkv * d
    if q_size <= 0 or q_size % d != 0 or d % 2 != 0:
        raise ValueError(
            f"qkv_rope_cache: qkv width {width} is not Hq * {d} + 2 * {hkv} * {d} for an even head dim"
        )
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(
            "qkv_rope_cache: k_cache and v_cache must share one shape and layout, last dim dense"
        )
    if rope_cos.shape != rope_sin.shape or rope_cos.shape[1:] != (d // 2,) or rope_cos.stride(1) != 1:
        raise ValueError(f"qkv_rope_cache: rope tables must be [max_positions, {d // 2}], last dim dense")
    if rope_cos.stride() != rope_sin.stride():
        raise ValueError("qkv_rope_cache: rope_cos and rope_sin must share one layout")
    if positions.shape != (t,) or slots.shape != (t,):
        raise ValueError(f"qkv_rope_cache: positions and slots must be [{t}]")
    for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
        if norm is not None and norm.shape != (d,):
            raise ValueError(f"qkv_rope_cache: {name} has shape {tuple(norm.shape)}, expected ({d},)")
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    hq = q_size // d
    q = torch.empty((t, hq, d), device=qkv.device, dtype=qkv.dtype)
    if t == 0:
        return q
    block_d = triton.next_power_of_2(d)
    num_warps = norm_warps(block_d)
    options = launch_options(qkv.device, dependent)
    _qkv_rope_cache_kernel[(t, hq + hkv)](
        qkv,
        qkv if q_norm is None else q_norm,  # never read without a norm: NORM_Q is then False
        qkv if k_norm is None else k_norm,
        rope_cos,
        rope_sin,
        positions,
        slots,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        rope_cos.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page,
        d,
        eps,
        HQ=hq,
        HKV=hkv,
        HALF=triton.next_power_of_2(d // 2),
        BLOCK_D=block_d,
        NORM_Q=q_norm is not None,
        NORM_K=k_norm is not None,
        **options,
        num_warps=num_warps,
    )
    return q
