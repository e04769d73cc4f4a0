"""Batch-invariant multi-head latent attention (DeepSeek-V2/V3) over its compressed paged cache, on the GPU.

A cache row per token holds the latent `c` (R = kv_lora_rank wide) and the rotated key `k_rot` (P wide), shared by
every head: a head's score for a key is q_lat . c + q_rot . k_rot, and its value is the key's `c` (pinned_backend/
latent.py maps queries into the latent and outputs back out). So one row of keys serves all H heads, which is what
makes the cache small, and the kernel reads it once for `_HEADS` heads at a time.

One program owns one query token and `_HEADS` of its heads (grid [T, ceil(H / _HEADS)]); it walks the token's keys 0..p
in chunks of `split` counted from position 0, and inside a chunk in tiles of `KV_TILE` keys from the chunk's first,
each chunk an online softmax of its own merged into the running total in chunk order (attention.py's `_merge`, the
same helper). Nothing a program does depends on another token or on how many tokens the step has: T reaches the
kernel only as the grid, so a row's bits are a function of its own query and keys, however the cache was filled and
whatever else is in the step. R and P must be powers of two of at least 16 (512 and 64 in DeepSeek-V3).

Layouts: q [T, H, R + P] (the latent part first); cache [num_blocks, block_size, 1, R + P]; block_tables
[S, max_blocks] int32; query_seq, query_pos [T] int32 -> [T, H, R] in q's dtype. This module knows nothing of how
the cache is written or what the heads do with their output.
"""

from __future__ import annotations

import math

import torch

from ._compat import tl, triton
from .attention import KV_TILE, _fresh, _merge, _normalise
from .dependent_launch import launch_options, start_as_dependent

_HEADS = 16  # heads a program serves: the smallest tensor-core tile's rows
_TILE = 32  # keys per tile: R + P wide rows make a 64-key tile's registers spill
_NUM_WARPS, _NUM_STAGES = 8, 2


@triton.jit
def _latent_chunk(
    q_lat,
    q_rot,
    cache_ptr,
    table,
    pos,
    lo,
    hi,
    scale_log2,
    stride_cb,
    stride_cs,
    HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One chunk's online softmax over keys lo..hi-1 for every head of the program -> (m, l, acc [HEADS, LATENT])."""
    lat = tl.arange(0, LATENT)
    rot = LATENT + tl.arange(0, ROPE)
    keys = tl.arange(0, BLOCK_N)
    every = tl.full((HEADS,), 1, tl.int1)
    m_i, l_i, acc = _fresh(HEADS, LATENT)
    for start in range(lo, hi, BLOCK_N):
        kv_pos = start + keys
        kv_ok = kv_pos <= pos
        page = tl.load(table + kv_pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
        row = cache_ptr + page * stride_cb + (kv_pos % PAGE) * stride_cs
        c = tl.load(row[:, None] + lat[None, :], mask=kv_ok[:, None], other=0.0)
        k_rot = tl.load(row[:, None] + rot[None, :], mask=kv_ok[:, None], other=0.0)
        s = (tl.dot(q_lat, tl.trans(c)) + tl.dot(q_rot, tl.trans(k_rot))) * scale_log2
        s = tl.where(every[:, None] & kv_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(c.dtype), c, acc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _latent_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    H,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ot,
    stride_oh,
    stride_table,
    HEADS: tl.constexpr,
    LATENT: tl.constexpr,
    ROPE: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    lat = tl.arange(0, LATENT)
    rot = LATENT + tl.arange(0, ROPE)
    mine = head < H
    q_row = q_ptr + tok * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :], mask=mine[:, None], other=0.0)
    q_rot = tl.load(q_row + rot[None, :], mask=mine[:, None], other=0.0)
    pos = tl.load(pos_ptr + tok)
    table = tables_ptr + tl.load(seq_ptr + tok).to(tl.int64) * stride_table
    tot_m, tot_l, tot_acc = _fresh(HEADS, LATENT)
    for chunk in range(0, pos // SPLIT + 1):
        lo = chunk * SPLIT
        hi = tl.minimum(lo + SPLIT, pos + 1)
        m_i, l_i, acc = _latent_chunk(
            q_lat, q_rot, cache_ptr, table, pos, lo, hi, scale_log2, stride_cb, stride_cs,
            HEADS, LATENT, ROPE, PAGE, BLOCK_N,
        )  # fmt: skip
        tot_m, tot_l, tot_acc = _merge(tot_m, tot_l, tot_acc, m_i, l_i, acc)
    tl.store(
        out_ptr + tok * stride_ot + head[:, None] * stride_oh + lat[None, :],
        _normalise(tot_l, tot_acc, mine).to(out_ptr.dtype.element_ty),
        mask=mine[:, None],
    )


def latent_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    split: int,
    v_dim: int,
    *,
    dependent: bool = True,
) -> torch.Tensor:
    """Each query over its sequence's cache rows 0..query_pos -> [T, H, v_dim] in q's dtype (module docstring)."""
    t, heads, width = q.shape
    _, page, cache_heads, cache_width = cache.shape
    rope = width - v_dim
    if cache_heads != 1 or cache_width != width:
        raise ValueError(f"latent attention: a cache of [.., .., 1, {width}] rows for q [T, H, {width}]")
    for name, size in (("latent", v_dim), ("rotated", rope)):
        if size < 16 or size & (size - 1):
            raise ValueError(
                f"latent attention: the {name} width {size} must be a power of two of at least 16"
            )
    if split % KV_TILE:
        raise ValueError(f"latent attention: kv split size {split} must be a multiple of {KV_TILE}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((t, heads, v_dim), device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    _latent_attention_kernel[(t, -(-heads // _HEADS))](
        q, cache, out, block_tables, query_seq, query_pos, heads, scale * math.log2(math.e),
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), HEADS=_HEADS, LATENT=v_dim, ROPE=rope, PAGE=page, SPLIT=split, BLOCK_N=_TILE,
        **launch_options(q.device, dependent), num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )  # fmt: skip
    return out
