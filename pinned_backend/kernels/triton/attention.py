"""Batch-invariant causal attention over a paged KV cache on the GPU, for prefill, chunked prefill and decode alike.

One kernel serves every step. A query at position p attends to keys 0..p of its sequence, walked in chunks of
`split` keys (the stack's `kv_split_size`) and, inside a chunk, in tiles of `_BLOCK_N` keys, always from the
chunk's first key. Each chunk gets its own online softmax, and chunk results are merged in chunk order 0, 1, 2, ...
So the reduction order for a query depends on p and the split size alone: not on how the cache was filled (one
prefill, chunks, decode steps), not on which other queries share the step, not on where the query sits in it.

A program owns one, or up to `_ROWS // group`, consecutive query tokens and one KV head; its rows are (token, query head of
that KV head's group) pairs. Tokens of different sequences in one program are served one sequence at a time.
A row meets tiles past its own position only as fully masked tiles, whose update is exactly the identity
(scale 1, add 0), so sharing a program with longer queries leaves its bits unchanged.

Layouts (see kernels/__init__.py): q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
block_tables [S, max_blocks] int32; query_seq, query_pos [T] int32. This module knows nothing of how the cache is
allocated or written.
"""

from __future__ import annotations

import math

import torch

from ._compat import tl, triton

_ROWS = 16  # rows of one program's query tile: the smallest tensor-core tile
_BLOCK_N = 64  # keys per tile; divides every split size we accept


# T is not specialised: a step of one token must run the same binary as any other step.
@triton.jit(do_not_specialize=["T"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    T,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    kv_head = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    tok = tl.program_id(0) * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < T)
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    row_seq = tl.load(seq_ptr + tok, mask=row_ok, other=-1)
    row_pos = tl.load(pos_ptr + tok, mask=row_ok, other=-1)
    result = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    pending = row_ok

    for _ in range(TOKENS):
        # The next sequence is the one of the first row not yet served; an empty round does no work.
        first = tl.min(tl.where(pending, rows, ROWS), axis=0)
        seq = tl.max(tl.where(rows == first, row_seq, -1), axis=0)
        mine = pending & (row_seq == seq)
        last_pos = tl.max(tl.where(mine, row_pos, -1), axis=0)
        n_chunks = tl.where(first < ROWS, last_pos // SPLIT + 1, 0)
        table = tables_ptr + seq.to(tl.int64) * stride_table

        tot_m = tl.full((ROWS,), float("-inf"), tl.float32)
        tot_l = tl.zeros((ROWS,), tl.float32)
        tot_acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
        for chunk in range(0, n_chunks):
            lo = chunk * SPLIT
            hi = tl.minimum(lo + SPLIT, last_pos + 1)
            m_i = tl.full((ROWS,), float("-inf"), tl.float32)
            l_i = tl.zeros((ROWS,), tl.float32)
            acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
            for start in range(lo, hi, BLOCK_N):
                kv_pos = start + keys
                kv_ok = kv_pos <= last_pos
                page = tl.load(table + kv_pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
                slot = kv_pos % PAGE
                k = tl.load(
                    k_ptr
                    + page[:, None] * stride_kb
                    + slot[:, None] * stride_ks
                    + kv_head * stride_kh
                    + dims[None, :],
                    mask=kv_ok[:, None],
                    other=0.0,
                )
                s = tl.dot(q, tl.trans(k)) * scale_log2
                visible = mine[:, None] & (kv_pos[None, :] <= row_pos[:, None])
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_ref[:, None])
                alpha = tl.exp2(m_i - m_ref)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(
                    v_ptr
                    + page[:, None] * stride_vb
                    + slot[:, None] * stride_vs
                    + kv_head * stride_vh
                    + dims[None, :],
                    mask=kv_ok[:, None],
                    other=0.0,
                )
                acc = acc * alpha[:, None]
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
            # Merge this chunk into the running total; chunk order is the reduction order.
            tot_new = tl.maximum(tot_m, m_i)
            tot_ref = tl.where(tot_new == float("-inf"), 0.0, tot_new)
            a = tl.exp2(tot_m - tot_ref)
            b = tl.exp2(m_i - tot_ref)
            tot_l = tot_l * a + l_i * b
            tot_acc = tot_acc * a[:, None] + acc * b[:, None]
            tot_m = tot_new

        safe_l = tl.where(mine, tot_l, 1.0)
        result = tl.where(mine[:, None], tot_acc / safe_l[:, None], result)
        pending = pending & ~mine

    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    split: int,
) -> torch.Tensor:
    """Causal attention of each query over its sequence's cached keys 0..query_pos -> [T, Hq, D] in q's dtype."""
    t, hq, d = q.shape
    _, page, hkv, d_k = k_cache.shape
    if d_k != d or v_cache.shape != k_cache.shape:
        raise ValueError("attention: q, k_cache and v_cache disagree on shape")
    if hq % hkv != 0 or _ROWS % (hq // hkv) != 0:
        raise ValueError(f"attention: {hq} query heads over {hkv} KV heads is not a supported grouping")
    if split % _BLOCK_N != 0:
        raise ValueError(f"attention: kv split size {split} must be a multiple of {_BLOCK_N}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((t, hq, d), device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    group = hq // hkv
    # How many query tokens share a program's 16 rows follows the step: one when the step is mostly decode
    # (one query per sequence, so no keys to share and more programs in flight), else as many as fit. It decides
    # which rows sit side by side, never a row's reduction order: tile shapes, and so every instruction a row
    # meets, are the same either way (the tests compare the two).
    tokens = 1 if t <= block_tables.shape[0] else _ROWS // group
    grid = (-(-t // tokens), hkv)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_seq,
        query_pos,
        t,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=group,
        TOKENS=tokens,
        ROWS=_ROWS,
        HEAD_DIM=d,
        PAGE=page,
        SPLIT=split,
        BLOCK_N=_BLOCK_N,
        num_warps=4,
        num_stages=2,
    )
    return out
