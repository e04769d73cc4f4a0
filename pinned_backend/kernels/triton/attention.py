"""Batch-invariant causal attention over a paged KV cache on the GPU, for prefill, chunked prefill and decode alike.

A query at position p attends to keys 0..p of its sequence, walked in chunks of `split` keys (the stack's
`kv_split_size`) and, inside a chunk, in tiles of `KV_TILE` keys, always from the chunk's first key. Each chunk
gets its own online softmax, and chunk results are merged in chunk order 0, 1, 2, ... So the reduction order for
a query depends on p and the split size alone: not on how the cache was filled (one prefill, chunks, decode
steps), not on which other queries share the step, not on where the query sits in it, and not on which of the two
paths below serves it.

Serial path, one kernel, grid (programs of query tokens, Hkv). A program owns one, or up to `_ROWS // group`,
consecutive query tokens and one KV head; its rows are (token, query head of that KV head's group) pairs. It walks
all chunks of its rows itself, merging each into a running total. Tokens of different sequences in one program are
served one sequence at a time. A row meets tiles and chunks past its own position only as fully masked ones,
whose update is exactly the identity (scale 1, add 0), so sharing a program with longer queries leaves its bits
unchanged. This path serves prefill and mixed steps.

Chunks path, two kernels, for steps of a few query tokens a sequence (decode, speculative verify passes). First grid
(T, Hkv, max_chunks), with max_chunks = ceil(max_blocks * block_size / split): one program per (token, KV head,
chunk), so a lone decode query keeps several programs busy instead of one walking its chunks serially. Each runs
its chunk's online softmax over the same 16-row tile as the serial path and stores the chunk's running max m, sum
l and unnormalised acc [rows, D] in an fp32 workspace; programs whose chunk starts past their query's position
return at once. Then grid (T, Hkv): each program merges chunks 0..p // split of its rows in order, from the same
start state, and writes the output. `max_chunks` comes from the block table's width, never from the batch's
contents, so a step launches without reading anything back from the device (decode steps run in CUDA graphs).

Why the two paths give the same bits: the tile loop of a chunk (`_attend_chunk`), the start state (`_fresh`), the
merge of one chunk into the total (`_merge`) and the final division (`_normalise`) are each one `@triton.jit`
function that both paths call, with the same tile shapes, warps and stages, so both compile the same arithmetic,
down to which multiply the compiler fuses with an add (`tot * a + x * b` becomes fma(tot, a, x * b) in both).
The workspace holds the fp32 partials exactly, and the serial path's extra merges of fully masked chunks are the
identity. The workspace grows with T * Hq * max_chunks * D; past `_WORKSPACE_LIMIT` a decode step takes the
serial path, with the same bits.

The variants, each a function of the row's own position and head, on both paths alike: a sliding `window` masks keys
at or before p - window, and chunks wholly before the window are skipped (a program starts at the first chunk any of
its rows sees; the chunks it walks that a row does not see are, for that row, fully masked, the identity as above);
`SOFTCAP` replaces each score by cap * tanh(score / cap), tanh spelled with exp2 so that its bits are the same
wherever it runs; `sinks` adds one logit per head with no value to the softmax, once, in `_finish`, after the last
chunk's merge.

Layouts (see kernels/__init__.py): q [T, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
block_tables [S, max_blocks] int32; query_seq, query_pos [T] int32. This module knows nothing of how the cache is
allocated or written.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch

from ._compat import tl, triton
from .dependent_launch import launch_options, start_as_dependent

_ROWS = 16  # rows of one program's query tile: the smallest tensor-core tile
KV_TILE = 64  # keys per tile; divides every split size we accept
# Every attention kernel launches with these: the shared tile loop must compile to the same instructions in each.
_NUM_WARPS, _NUM_STAGES = 4, 2
_WORKSPACE_LIMIT = 64 << 20  # bytes of chunk partials a decode step may take before it walks chunks serially
_CHUNKS_TOKENS_PER_SEQUENCE = 8  # the most tokens a sequence a step may have and still take the chunks path

AttentionPath = Literal["auto", "chunks", "serial"]


@triton.jit
def _fresh(ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The (m, l, acc) of an online softmax that has seen no key."""
    return (
        tl.full((ROWS,), float("-inf"), tl.float32),
        tl.zeros((ROWS,), tl.float32),
        tl.zeros((ROWS, HEAD_DIM), tl.float32),
    )


@triton.jit
def _attend_chunk(
    q,
    k_ptr,
    v_ptr,
    table,
    kv_head,
    mine,
    row_pos,
    last_pos,
    lo,
    hi,
    scale_log2,
    window,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Online softmax of rows `mine` (each seeing keys up to its `row_pos`, and past row_pos - window if WINDOWED)
    over keys lo..hi-1 -> (m, l, acc)."""
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK_N)
    m_i, l_i, acc = _fresh(ROWS, HEAD_DIM)
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
        s = _scores(tl.dot(q, tl.trans(k)), scale_log2, SOFTCAP)
        visible = mine[:, None] & (kv_pos[None, :] <= row_pos[:, None])
        if WINDOWED:
            visible = visible & (kv_pos[None, :] > row_pos[:, None] - window)
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
    return m_i, l_i, acc


@triton.jit
def _scores(dots, scale_log2, SOFTCAP: tl.constexpr):
    """q.k in the log2 domain exp2 takes; soft-capped first where SOFTCAP > 0 (cap * tanh(score / cap), tanh as
    1 - 2 / (exp2(2 * log2(e) * x) + 1))."""
    if SOFTCAP > 0:
        x = dots * (scale_log2 * 0.6931471805599453 / SOFTCAP)  # ln(2): back to the natural scale
        capped = SOFTCAP * (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))  # 2 * log2(e)
        return capped * 1.4426950408889634
    return dots * scale_log2


@triton.jit
def _first_chunk(row_pos, mine, window, SPLIT: tl.constexpr, WINDOWED: tl.constexpr):
    """The first chunk any of rows `mine` sees: 0, or with a window the one holding the lowest row's first key."""
    if WINDOWED:
        lowest = tl.min(tl.where(mine, row_pos, 1 << 30), axis=0)
        return tl.maximum(lowest - window + 1, 0) // SPLIT
    return 0


@triton.jit
def _merge(tot_m, tot_l, tot_acc, m_i, l_i, acc):
    """The running total after one more chunk; chunk order is the reduction order."""
    tot_new = tl.maximum(tot_m, m_i)
    tot_ref = tl.where(tot_new == float("-inf"), 0.0, tot_new)
    a = tl.exp2(tot_m - tot_ref)
    b = tl.exp2(m_i - tot_ref)
    tot_l = tot_l * a + l_i * b
    tot_acc = tot_acc * a[:, None] + acc * b[:, None]
    return tot_new, tot_l, tot_acc


@triton.jit
def _normalise(tot_l, tot_acc, mine):
    safe_l = tl.where(mine, tot_l, 1.0)
    return tot_acc / safe_l[:, None]


@triton.jit
def _finish(tot_m, tot_l, tot_acc, mine, sinks_ptr, head, SINKS: tl.constexpr):
    """The output after the last chunk: with sinks, one more logit per head that adds to the sum only."""
    if SINKS:
        sink = tl.load(sinks_ptr + head, mask=mine, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(tot_m, sink)
        keep = tl.exp2(tot_m - m_new)
        tot_l = tot_l * keep + tl.exp2(sink - m_new)
        tot_acc = tot_acc * keep[:, None]
    return _normalise(tot_l, tot_acc, mine)


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
    sinks_ptr,
    T,
    scale_log2,
    window,
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
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    tok = tl.program_id(0) * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < TOKENS * GROUP) & (tok < T)
    dims = tl.arange(0, HEAD_DIM)

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

        tot_m, tot_l, tot_acc = _fresh(ROWS, HEAD_DIM)
        for chunk in range(_first_chunk(row_pos, mine, window, SPLIT, WINDOWED), n_chunks):
            lo = chunk * SPLIT
            hi = tl.minimum(lo + SPLIT, last_pos + 1)
            m_i, l_i, acc = _attend_chunk(
                q, k_ptr, v_ptr, table, kv_head, mine, row_pos, last_pos, lo, hi, scale_log2, window,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                ROWS, HEAD_DIM, PAGE, BLOCK_N, WINDOWED, SOFTCAP,
            )  # fmt: skip
            tot_m, tot_l, tot_acc = _merge(tot_m, tot_l, tot_acc, m_i, l_i, acc)

        done = _finish(tot_m, tot_l, tot_acc, mine, sinks_ptr, head, SINKS)
        result = tl.where(mine[:, None], done, result)
        pending = pending & ~mine

    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def _paged_attention_chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    m_ws_ptr,
    l_ws_ptr,
    acc_ws_ptr,
    tables_ptr,
    seq_ptr,
    pos_ptr,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    stride_wt,
    stride_wh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.program_id(2)
    last_pos = tl.load(pos_ptr + tok)
    lo = chunk * SPLIT
    if lo > last_pos:
        return
    if WINDOWED:  # noqa: SIM102  (a constexpr branch, settled when the kernel compiles)
        if chunk < tl.maximum(last_pos - window + 1, 0) // SPLIT:
            return
    hi = tl.minimum(lo + SPLIT, last_pos + 1)
    rows = tl.arange(0, ROWS)
    head = kv_head * GROUP + rows % GROUP
    mine = rows < GROUP
    row_pos = tl.where(mine, last_pos, -1)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + tok * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=mine[:, None], other=0.0
    )
    table = tables_ptr + tl.load(seq_ptr + tok).to(tl.int64) * stride_table
    m_i, l_i, acc = _attend_chunk(
        q, k_ptr, v_ptr, table, kv_head, mine, row_pos, last_pos, lo, hi, scale_log2, window,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        ROWS, HEAD_DIM, PAGE, BLOCK_N, WINDOWED, SOFTCAP,
    )  # fmt: skip
    # m_ws, l_ws [T, Hq, C]; acc_ws [T, Hq, C, D]
    slot = tok.to(tl.int64) * stride_wt + head * stride_wh + chunk
    tl.store(m_ws_ptr + slot, m_i, mask=mine)
    tl.store(l_ws_ptr + slot, l_i, mask=mine)
    tl.store(acc_ws_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=mine[:, None])


@triton.jit
def _paged_attention_merge_kernel(
    m_ws_ptr,
    l_ws_ptr,
    acc_ws_ptr,
    out_ptr,
    pos_ptr,
    sinks_ptr,
    window,
    stride_wt,
    stride_wh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    start_as_dependent(PDL)
    tok = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    head = kv_head * GROUP + rows % GROUP
    mine = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    last_pos = tl.load(pos_ptr + tok)
    n_chunks = last_pos // SPLIT + 1
    first_slot = tok.to(tl.int64) * stride_wt + head * stride_wh

    tot_m, tot_l, tot_acc = _fresh(ROWS, HEAD_DIM)
    for chunk in range(_first_chunk(tl.where(mine, last_pos, -1), mine, window, SPLIT, WINDOWED), n_chunks):
        slot = first_slot + chunk
        m_i = tl.load(m_ws_ptr + slot, mask=mine, other=float("-inf"))
        l_i = tl.load(l_ws_ptr + slot, mask=mine, other=0.0)
        acc = tl.load(acc_ws_ptr + slot[:, None] * HEAD_DIM + dims[None, :], mask=mine[:, None], other=0.0)
        tot_m, tot_l, tot_acc = _merge(tot_m, tot_l, tot_acc, m_i, l_i, acc)

    tl.store(
        out_ptr + tok * stride_ot + head[:, None] * stride_oh + dims[None, :],
        _finish(tot_m, tot_l, tot_acc, mine, sinks_ptr, head, SINKS).to(out_ptr.dtype.element_ty),
        mask=mine[:, None],
    )


def choose_path(
    t: int, n_seqs: int, hq: int, d: int, max_chunks: int, path: AttentionPath
) -> Literal["chunks", "serial"]:
    """The path for a step of t query tokens over a block table of n_seqs rows and max_chunks chunks.

    "auto" takes the chunks path when the step has at most `_CHUNKS_TOKENS_PER_SEQUENCE` tokens a sequence (decode,
    and a speculative verify pass of a few drafts: tokens that would gain little from sharing a program's loads of
    keys) and the workspace fits `_WORKSPACE_LIMIT`. Either path gives the same bits, so this decides speed only.
    """
    if path not in ("auto", "chunks", "serial"):
        raise ValueError(f"attention: unknown path {path!r}; choose auto, chunks or serial")
    if path != "auto":
        return path
    fits = t * hq * max_chunks * d * 4 <= _WORKSPACE_LIMIT
    return "chunks" if t <= n_seqs * _CHUNKS_TOKENS_PER_SEQUENCE and fits else "serial"


class Variant(NamedTuple):
    """What a layer's attention adds to plain causal attention (module docstring)."""

    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq] float32


PLAIN = Variant()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
    split: int,
    *,
    path: AttentionPath = "auto",
    dependent: bool = True,
    variant: Variant = PLAIN,
) -> torch.Tensor:
    """Causal attention of each query over its sequence's cached keys 0..query_pos -> [T, Hq, D] in q's dtype.

    `path` forces one of the two paths (same bits either way); it is for tests and benchmarks only, and the
    stack always runs "auto". Not `dependent`: never launched as programmatic dependents (`launch_options`).
    """
    t, hq, d = q.shape
    _, page, hkv, d_k = k_cache.shape
    if d_k != d or v_cache.shape != k_cache.shape:
        raise ValueError("attention: q, k_cache and v_cache disagree on shape")
    if hq % hkv != 0 or hq // hkv > _ROWS:
        raise ValueError(f"attention: {hq} query heads over {hkv} KV heads is not a supported grouping")
    if split % KV_TILE != 0:
        raise ValueError(f"attention: kv split size {split} must be a multiple of {KV_TILE}")
    if variant.sinks is not None and variant.sinks.shape != (hq,):
        raise ValueError(f"attention: sinks must be [{hq}], one per query head")
    if q.stride(-1) != 1:
        q = q.contiguous()
    max_chunks = max(1, -(-(block_tables.shape[1] * page) // split))
    chosen = choose_path(t, block_tables.shape[0], hq, d, max_chunks, path)
    out = torch.empty((t, hq, d), device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    options = launch_options(q.device, dependent)
    args = (q, k_cache, v_cache, block_tables, query_seq, query_pos, scale * math.log2(math.e), split, out)
    if chosen == "chunks":
        _launch_chunks(*args, max_chunks, _constants(variant, q), options)
    else:
        _launch_serial(*args, _constants(variant, q), options)
    return out


def _constants(variant: Variant, q: torch.Tensor) -> dict[str, Any]:
    """A variant as the kernels take it: a runtime window, and what is settled when a kernel compiles."""
    return {
        "window": variant.window or 0,
        "sinks_ptr": q if variant.sinks is None else variant.sinks,  # never read without sinks
        "WINDOWED": variant.window is not None,
        "SOFTCAP": float(variant.softcap or 0.0),
        "SINKS": variant.sinks is not None,
    }


def _launch_serial(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    scale_log2: float,
    split: int,
    out: torch.Tensor,
    variant: dict[str, Any],
    options: dict[str, bool],
) -> None:
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    # How many query tokens share a program's 16 rows follows the step: one when the step is mostly decode
    # (one query per sequence, so no keys to share and more programs in flight), else as many as fit. It decides
    # which rows sit side by side, never a row's reduction order: tile shapes, and so every instruction a row
    # meets, are the same either way (the tests compare the two).
    tokens = 1 if t <= block_tables.shape[0] else _ROWS // group
    _paged_attention_kernel[(-(-t // tokens), hkv)](
        q, k_cache, v_cache, out, block_tables, query_seq, query_pos, T=t, scale_log2=scale_log2,
        stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_table=block_tables.stride(0),
        GROUP=group, TOKENS=tokens, ROWS=_ROWS, HEAD_DIM=d, PAGE=k_cache.shape[1], SPLIT=split, BLOCK_N=KV_TILE,
        **variant, **options, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )  # fmt: skip


def _launch_chunks(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_seq: torch.Tensor,
    query_pos: torch.Tensor,
    scale_log2: float,
    split: int,
    out: torch.Tensor,
    max_chunks: int,
    variant: dict[str, Any],
    options: dict[str, bool],
) -> None:
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    # Slots of chunks past a query's position, or before its window, are never written and never read.
    m_ws = torch.empty((t, hq, max_chunks), device=q.device, dtype=torch.float32)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((t, hq, max_chunks, d), device=q.device, dtype=torch.float32)
    shared = {"GROUP": group, "ROWS": _ROWS, "HEAD_DIM": d, "SPLIT": split, "WINDOWED": variant["WINDOWED"]}
    _paged_attention_chunk_kernel[(t, hkv, max_chunks)](
        q, k_cache, v_cache, m_ws, l_ws, acc_ws, block_tables, query_seq, query_pos,
        scale_log2=scale_log2, window=variant["window"], stride_qt=q.stride(0), stride_qh=q.stride(1),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_table=block_tables.stride(0), stride_wt=m_ws.stride(0), stride_wh=m_ws.stride(1),
        PAGE=k_cache.shape[1], BLOCK_N=KV_TILE, SOFTCAP=variant["SOFTCAP"],
        **shared, **options, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )  # fmt: skip
    _paged_attention_merge_kernel[(t, hkv)](
        m_ws, l_ws, acc_ws, out, query_pos, variant["sinks_ptr"], window=variant["window"],
        stride_wt=m_ws.stride(0), stride_wh=m_ws.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        SINKS=variant["SINKS"], **shared, **options, num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )  # fmt: skip
