"""Batch-invariant matmul `x [M, K] @ w[N, K].T -> [M, N]` on the GPU, bf16 or fp16 in, fp32 accumulation.

The kernels that run a plan's tiles (matmul_plans.py says what decides a result's bits, and what may follow M):
- `_matmul_kernel`: one program per tile, or per tile and slice of K, whose fp32 partials the tile's last program
  to finish adds in slice order; plain loads or the tensor-memory engine; the weight's rows as the tensor cores'
  rows or x's (swapped, with an optional tail block of x's rows).
- `_matmul_stream_kernel`: up to one program per multiprocessor, each an equal run of one row tile's K steps, a
  chain cut between two programs carrying its fp32 accumulator from one to the next; plain loads or the
  tensor-memory engine.
A plan may also name a tile run by one of the Gluon kernels of matmul_gluon.py and matmul_gluon_swapped.py.
`matmul` takes a plan (the weight's, from matmul_plans.py's `MatmulPlans`) and the tile for M, and launches it, its
launch state (arrival counters, dependent launch) held by a `Launches` (launches.py). This module knows nothing of
models, of scheduling or of where plans come from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from ._compat import HAVE_TRITON, interpreted, tl, triton
from .dependent_launch import launch_options, start_as_dependent
from .launches import Launches
from .matmul_gluon import HAVE_GLUON
from .matmul_gluon_launch import launch_gluon
from .matmul_plans import LARGE_M, SWAPPED_PARTITION_ROWS, MatmulPlan, MatmulTile

if HAVE_TRITON:
    from triton.tools.tensor_descriptor import TensorDescriptor

# Row tiles per band of the launch order (see the kernel); 16 bands of 128 rows of a K = 6144 x take 24 MiB of L2.
_GROUP_M = 16


# M is not specialised (Triton would otherwise compile M == 1 and M % 16 == 0 apart): one binary per tile.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    SLICES: tl.constexpr,
    PROGRAMS_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    N_TILES: tl.constexpr,
    GROUP_M: tl.constexpr,
    TMA: tl.constexpr,
    SWAP: tl.constexpr,
    TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    # Programs walk bands of GROUP_M row tiles; inside a band, row tiles vary fastest. So the programs in flight
    # share one weight tile through L2, and a band's rows of x stay in L2 while the weight streams past them. With
    # M of GROUP_M row tiles or fewer (every decode step) this is plain row-fastest order; at prefill sizes, where
    # x outgrows L2, it keeps x from being read once per weight tile. The order decides nothing but speed.
    pid = tl.program_id(0)
    # A program's rows of x: a main block of BLOCK_M and, for a swapped tile with a tail, TAIL more right after it,
    # both against the one weight tile it loads (so M = 144 is one block of 128 and one of 16, with no idle rows).
    CHUNK: tl.constexpr = BLOCK_M + TAIL
    num_m = tl.cdiv(M, CHUNK)
    band = pid // (GROUP_M * N_TILES)
    first_m = band * GROUP_M
    band_rows = tl.minimum(num_m - first_m, GROUP_M)
    in_band = pid % (GROUP_M * N_TILES)
    pid_m = first_m + in_band % band_rows
    pid_n = in_band // band_rows
    # This program reduces slices pid_k * SLICES .. pid_k * SLICES + SLICES - 1.
    pid_k = tl.program_id(1)

    offs_m = pid_m * CHUNK + tl.arange(0, BLOCK_M)
    TAIL_ROWS: tl.constexpr = TAIL if TAIL > 0 else 16  # a shape for the unused tail when there is none
    offs_t = pid_m * CHUNK + BLOCK_M + tl.arange(0, TAIL_ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M are masked, so they cost no memory traffic (re-reading a valid row instead made the 63 idle
    # rows of an M = 1 tile hit one address and ran 1.5x slower); columns past N re-read a valid column, and
    # the store drops them. Each row's result depends on its own inputs only, either way.
    row_ok = (offs_m < M)[:, None]
    tail_ok = (offs_t < M)[:, None]
    cols = offs_n % N
    k_lo = pid_k * SLICES * K_PER_SPLIT

    start_as_dependent(PDL)

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    xt_ptrs = x_ptr + offs_t[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + cols[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    # Swapped, the accumulator is out's tile transposed: [BLOCK_N, BLOCK_M].
    ACC_ROWS: tl.constexpr = BLOCK_N if SWAP else BLOCK_M
    ACC_COLS: tl.constexpr = BLOCK_M if SWAP else BLOCK_N
    total = tl.zeros((ACC_ROWS, ACC_COLS), dtype=tl.float32)
    total_t = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
    for s in tl.static_range(SLICES):
        acc = tl.zeros((ACC_ROWS, ACC_COLS), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            if TMA:
                # The tensor-memory engine copies the same operand values (rows and columns past the ends come
                # back as zeros), so the dot chain, and every valid row's bits, are the pointer path's.
                k_at = k_lo + s * K_PER_SPLIT + kk
                x = x_desc.load([pid_m * BLOCK_M, k_at])
                w = w_desc.load([pid_n * BLOCK_N, k_at])
            elif EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok, other=0.0)
                w = tl.load(w_ptrs)
                if TAIL > 0:
                    xt = tl.load(xt_ptrs, mask=tail_ok, other=0.0)
            else:
                k_ok = ((kk + offs_k) < K)[None, :]
                x = tl.load(x_ptrs, mask=row_ok & k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=k_ok, other=0.0)
                if TAIL > 0:
                    xt = tl.load(xt_ptrs, mask=tail_ok & k_ok, other=0.0)
            if SWAP:  # noqa: SIM108  (a constexpr branch, as below)
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
            if TAIL > 0:
                acc_t = tl.dot(w, tl.trans(xt), acc_t)
                xt_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        # The first slice is taken as it is, as the sum of separate programs' slices takes it: 0.0 + (-0.0) would
        # flip a sign bit.
        if s == 0:
            total = acc
            total_t = acc_t
        else:
            total = total + acc
            total_t = total_t + acc_t

    if PROGRAMS_K == 1:
        _store_tile(out_ptr, total, offs_m, offs_n, M, N, stride_om, SWAP)
        if TAIL > 0:
            _store_tile(out_ptr, total_t, offs_t, offs_n, M, N, stride_om, True)
    else:
        # Slices in programs of their own: each leaves its fp32 partial, and the tile's last program to arrive adds
        # them in slice order 0, 1, 2, ... and writes the output, so which program arrives last never shows in the
        # bits. The barrier orders every thread's partial before the arrival, which releases them to the
        # program that acquires the last arrival; that one resets the counter for the next launch.
        _store_tile(part_ptr + pid_k * stride_os, total, offs_m, offs_n, M, N, stride_om, SWAP)
        if TAIL > 0:
            _store_tile(part_ptr + pid_k * stride_os, total_t, offs_t, offs_n, M, N, stride_om, True)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if arrived == PROGRAMS_K - 1:
            _add_partials(out_ptr, part_ptr, offs_m, offs_n, M, N, stride_om, stride_os, PROGRAMS_K, SWAP)
            if TAIL > 0:
                _add_partials(out_ptr, part_ptr, offs_t, offs_n, M, N, stride_om, stride_os, PROGRAMS_K, True)
            tl.store(arrivals_ptr + pid, 0)


# One binary per tile, as above.
@triton.jit(do_not_specialize=["M", "UNITS"])
def _matmul_stream_kernel(
    x_ptr,
    w_ptr,
    x_desc,
    w_desc,
    out_ptr,
    part_ptr,
    carry_ptr,
    flags_ptr,
    arrivals_ptr,
    M,
    N,
    K_PER_SPLIT,
    UNITS,
    stride_xm,
    stride_wn,
    stride_om,
    stride_os,
    SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    # Every (tile, slice of K) is a chain of K steps. A row tile's chains, laid end to end over the weight's
    # column tiles, are cut into runs of UNITS steps, one run per program: each multiprocessor gets the same work,
    # however many tiles M leaves for a last round. Programs come in groups of one program per row tile, and the
    # programs of a group take the same run of every row tile, so that they read each weight tile at about the
    # same time and all but the first find it in L2. (With a weight tile's row tiles one after another in one run,
    # read at different times, streamed tiles ran as fast as plain ones where a weight tile has one row tile, and up
    # to 1.8x slower where it has several.) A chain cut between two programs passes its fp32
    # accumulator on, an exact value, so it goes through the very steps, in the very order, that one program would
    # take it through. A run is never shorter than a chain (the launcher sees to it), so a program continues at
    # most one chain from the program before it on its row tile, and leaves at most one to the program after. It
    # starts that one first and leaves its accumulator in its carry slot; it continues the other one last, so it
    # seldom waits.
    #
    # A first version, which chose between a zero and a carried accumulator inside its loop over chains, gave one
    # program's bits on an H200 but ran 1.5 to 2 times slower than the plain tiles: ptxas serialized its
    # tensor-core steps (warning C7515). Here only zeros start a chain
    # inside that loop, and the carried chain has a loop of its own, so ptxas keeps the steps overlapped as in the
    # plain kernel.
    pid = tl.program_id(0)
    steps = K_PER_SPLIT // BLOCK_K
    m_tiles = tl.cdiv(M, BLOCK_M)
    row_tile = pid % m_tiles
    lo = pid // m_tiles * UNITS
    hi = tl.minimum(lo + UNITS, tl.cdiv(N, BLOCK_N) * SLICES * steps)
    carried_hi = tl.cdiv(lo, steps) * steps  # [lo, carried_hi): the chain continued from the program before
    last_lo = (hi - 1) // steps * steps
    leaves = (hi - last_lo < steps) & (last_lo >= carried_hi)
    lead_lo = tl.where(leaves, last_lo, hi)  # [lead_lo, hi): the chain left to the program after
    lead = hi - lead_lo
    has_lead = (lead > 0).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    carry_offsets = rows[:, None] * BLOCK_N + cols[None, :]

    start_as_dependent(PDL)

    # The chain left unfinished, then the whole ones, each from a zeroed accumulator as in every other tile; inside
    # a chain only the tensor cores write it, so that their steps overlap.
    chains = tl.cdiv(hi - carried_hi, steps)
    for r in range(0, chains):
        leaving = (r == 0) & (has_lead == 1)
        chain = tl.where(leaving, lead_lo, carried_hi + (r - has_lead) * steps) // steps
        offs_m, offs_n, k_at, x_ptrs, w_ptrs = _chain_at(
            chain, 0, row_tile, x_ptr, w_ptr, N, K_PER_SPLIT, stride_xm, stride_wn, SLICES, BLOCK_M, BLOCK_N, BLOCK_K
        )  # fmt: skip
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _k_steps(
            acc, x_ptrs, w_ptrs, x_desc, w_desc, row_tile * BLOCK_M, chain // SLICES * BLOCK_N, k_at,
            (offs_m < M)[:, None], tl.where(leaving, lead, steps), BLOCK_K, TMA,
        )  # fmt: skip
        if leaving:
            tl.store(carry_ptr + pid * BLOCK_M * BLOCK_N + carry_offsets, acc)
            tl.debug_barrier()
            tl.atomic_xchg(flags_ptr + pid, 1, sem="release", scope="gpu")
        else:
            _finish_chain(
                acc, out_ptr, part_ptr, arrivals_ptr, chain, row_tile, m_tiles, offs_m, offs_n, M, N, stride_om,
                stride_os, SLICES,
            )  # fmt: skip

    if carried_hi > lo:
        chain = lo // steps
        offs_m, offs_n, k_at, x_ptrs, w_ptrs = _chain_at(
            chain, lo - chain * steps, row_tile, x_ptr, w_ptr, N, K_PER_SPLIT, stride_xm, stride_wn, SLICES,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        before = pid - m_tiles  # the program before, on the same row tile
        ready = tl.atomic_add(flags_ptr + before, 0, sem="acquire", scope="gpu")
        while ready == 0:
            ready = tl.atomic_add(flags_ptr + before, 0, sem="acquire", scope="gpu")
        carried = tl.load(carry_ptr + before * BLOCK_M * BLOCK_N + carry_offsets, cache_modifier=".cg")
        tl.atomic_xchg(flags_ptr + before, 0, sem="relaxed", scope="gpu")
        carried = _k_steps(
            carried, x_ptrs, w_ptrs, x_desc, w_desc, row_tile * BLOCK_M, chain // SLICES * BLOCK_N, k_at,
            (offs_m < M)[:, None], carried_hi - lo, BLOCK_K, TMA,
        )  # fmt: skip
        _finish_chain(
            carried, out_ptr, part_ptr, arrivals_ptr, chain, row_tile, m_tiles, offs_m, offs_n, M, N, stride_om,
            stride_os, SLICES,
        )  # fmt: skip


@triton.jit
def _chain_at(
    chain, step, row_tile, x_ptr, w_ptr, N, K_PER_SPLIT, stride_xm, stride_wn,
    SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A chain's rows, columns, first K and first operand addresses, `step` K steps in. A row tile's chains are
    its column tiles' slices of K, a column tile's slices one after another."""
    offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (chain // SLICES) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_at = (chain % SLICES) * K_PER_SPLIT + step * BLOCK_K
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_at + tl.arange(0, BLOCK_K))[None, :]
    w_ptrs = w_ptr + (offs_n % N)[:, None] * stride_wn + (k_at + tl.arange(0, BLOCK_K))[None, :]
    return offs_m, offs_n, k_at, x_ptrs, w_ptrs


@triton.jit
def _k_steps(
    acc, x_ptrs, w_ptrs, x_desc, w_desc, row, col, k_at, row_ok, n, BLOCK_K: tl.constexpr, TMA: tl.constexpr
):  # fmt: skip
    for i in range(0, n):
        if TMA:
            # As in the tiled kernel: the copy engine gives the same operand values (zeros past the ends).
            x = x_desc.load([row, k_at + i * BLOCK_K])
            w = w_desc.load([col, k_at + i * BLOCK_K])
        else:
            x = tl.load(x_ptrs, mask=row_ok, other=0.0)
            w = tl.load(w_ptrs)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _finish_chain(
    acc,
    out_ptr,
    part_ptr,
    arrivals_ptr,
    chain,
    row_tile,
    m_tiles,
    offs_m,
    offs_n,
    M,
    N,
    stride_om,
    stride_os,
    SLICES: tl.constexpr,
):
    if SLICES == 1:
        _store_tile(out_ptr, acc, offs_m, offs_n, M, N, stride_om, False)
    else:
        # As slices in programs of their own meet (above): the tile's last slice to finish adds them in order.
        tile = chain // SLICES * m_tiles + row_tile
        _store_tile(part_ptr + (chain % SLICES) * stride_os, acc, offs_m, offs_n, M, N, stride_om, False)
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SLICES - 1:
            _add_partials(out_ptr, part_ptr, offs_m, offs_n, M, N, stride_om, stride_os, SLICES, False)
            tl.store(arrivals_ptr + tile, 0)


@triton.jit
def _add_partials(
    out_ptr, part_ptr, offs_m, offs_n, M, N, stride_om, stride_os, SLICES: tl.constexpr, SWAP: tl.constexpr
):
    total = _load_tile(part_ptr, offs_m, offs_n, M, N, stride_om, SWAP)
    for s in tl.static_range(1, SLICES):
        total += _load_tile(part_ptr + s * stride_os, offs_m, offs_n, M, N, stride_om, SWAP)
    _store_tile(out_ptr, total, offs_m, offs_n, M, N, stride_om, SWAP)


@triton.jit
def _tile_offsets(offs_m, offs_n, M, N, stride_om, SWAP: tl.constexpr):
    # Swapped, a tile is out's tile transposed: [columns, rows].
    if SWAP:
        return offs_m[None, :] * stride_om + offs_n[:, None], (offs_m[None, :] < M) & (offs_n[:, None] < N)
    else:
        return offs_m[:, None] * stride_om + offs_n[None, :], (offs_m[:, None] < M) & (offs_n[None, :] < N)


@triton.jit
def _store_tile(ptr, tile, offs_m, offs_n, M, N, stride_om, SWAP: tl.constexpr):
    offsets, mask = _tile_offsets(offs_m, offs_n, M, N, stride_om, SWAP)
    tl.store(ptr + offsets, tile.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_tile(ptr, offs_m, offs_n, M, N, stride_om, SWAP: tl.constexpr):
    # Other programs' partials, written on other multiprocessors: read past L1, which is not kept coherent.
    offsets, mask = _tile_offsets(offs_m, offs_n, M, N, stride_om, SWAP)
    return tl.load(ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")


def matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    plan: MatmulPlan,
    tile: MatmulTile | None = None,
    *,
    launches: Launches | None = None,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype, by `plan`'s tile for M, or by `tile` (benchmarks and tests that
    compare tiles), which must reduce K in the plan's order. Without `launches`, the launch keeps no state: its
    arrival counters are its own."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"matmul takes bf16 or fp16 operands of one dtype, got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n, k_w = w.shape
    if k != k_w:
        raise ValueError(f"matmul: x has K={k} but w has K={k_w}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    if tile is None:
        tile = plan.tile_for(m)
    else:
        MatmulPlan(plan.split_k, ((LARGE_M, tile),)).check(k)
    launches = launches or Launches()
    device = x.device
    out = torch.empty((m, n), device=device, dtype=x.dtype)
    if m == 0:
        return out
    split = plan.split_k
    programs_k = split if tile.split_programs and split > 1 else 1
    partials = arrivals = out
    if programs_k > 1:
        partials = torch.empty((split, m, n), device=device, dtype=torch.float32)
        arrivals = launches.arrival_counters(device, tile.tiles(m, n))
    dependent = launch_options(device, launches.dependent_launch)
    if tile.gluon:
        if _gluon_runs(x, w, out):
            launch_gluon(
                x,
                w,
                out,
                split,
                tile,
                _GROUP_M,
                _multiprocessors(device),
                partials,
                arrivals,
                dependent["PDL"],
            )
            return out
        # The same tile from a `tl.dot` kernel (its slices in the same programs as the Gluon kernel's), which
        # gives the same bits wherever both run: under Triton's interpreter, which runs no Gluon, and for views the
        # copy engine cannot read. Off Hopper, where `wgmma` does not exist, served plans hold no Gluon tile; one
        # named explicitly runs as its twin.
        twin = dataclasses.replace(tile, gluon="", tma=not tile.swap)
        if tile.partitions:
            # One partition's weight rows: a `tl.dot` tile's blocks are powers of two, and its rows' bits the same.
            twin = dataclasses.replace(twin, block_n=SWAPPED_PARTITION_ROWS)
        tile = twin
    if tile.stream:
        _launch_stream(x, w, out, split, tile, launches, dependent)
        return out
    grid = (tile.tiles(m, n), programs_k)
    tma, x_desc, w_desc = _descriptors(x, w, tile)
    _matmul_kernel[grid](
        x,
        w,
        x_desc,
        w_desc,
        out,
        partials,
        arrivals,
        m,
        n,
        k,
        k // split,
        x.stride(0),
        w.stride(0),
        n,
        m * n,
        SLICES=split // programs_k,
        PROGRAMS_K=programs_k,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        EVEN_K=k % tile.block_k == 0,
        N_TILES=-(-n // tile.block_n),
        GROUP_M=_GROUP_M,
        TMA=tma,
        SWAP=tile.swap,
        TAIL=tile.tail,
        **dependent,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


def _launch_stream(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    split: int,
    tile: MatmulTile,
    launches: Launches,
    dependent: dict[str, bool],
) -> None:
    (m, k), n, device = x.shape, w.shape[0], x.device
    steps = k // split // tile.block_k
    row_tiles, column_tiles = -(-m // tile.block_m), -(-n // tile.block_n)
    units = column_tiles * split * steps  # of one row tile
    # One group of programs per row tile's run, as many groups as fit on the multiprocessors at once, since a
    # program may wait on the one before it. Never a run shorter than a chain: chains cut finer would wait on each
    # other and add no parallel work.
    run = max(-(-units // max(1, _multiprocessors(device) // row_tiles)), steps)
    programs = -(-units // run) * row_tiles
    tiles = row_tiles * column_tiles
    partials = out if split == 1 else torch.empty((split, m, n), device=device, dtype=torch.float32)
    # Each slice's arrival per tile, then each program's carry flag: all zero between launches.
    counters = launches.arrival_counters(device, tiles + programs)
    carry = torch.empty((programs, tile.block_m * tile.block_n), device=device, dtype=torch.float32)
    tma, x_desc, w_desc = _descriptors(x, w, tile)
    _matmul_stream_kernel[(programs,)](
        x,
        w,
        x_desc,
        w_desc,
        out,
        partials,
        carry,
        counters[tiles:],
        counters,
        m,
        n,
        k // split,
        run,
        x.stride(0),
        w.stride(0),
        n,
        m * n,
        SLICES=split,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        TMA=tma,
        **dependent,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    # Under Triton's interpreter (tensors on the CPU), a few programs, so that chains are cut there too.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 6


def _descriptors(x: torch.Tensor, w: torch.Tensor, tile: MatmulTile) -> tuple[bool, Any, Any]:
    """Whether the tile loads through the copy engine, and if so its descriptors of x and w. The engine needs 16-byte
    aligned rows; a view that has none takes the same tile with plain loads, which gives the same bits."""
    if not (tile.tma and _tma_ready(x) and _tma_ready(w)):
        return False, None, None
    x_desc = TensorDescriptor.from_tensor(x, [tile.block_m, tile.block_k])
    return True, x_desc, TensorDescriptor.from_tensor(w, [tile.block_n, tile.block_k])


def _gluon_runs(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the Gluon kernels can take these operands: Gluon present, not Triton's interpreter (which runs no
    Gluon), a Hopper GPU (the kernels issue `wgmma`, sm_90's instruction alone), rows the copy engine can address."""
    return (
        HAVE_GLUON
        and not interpreted()
        and x.is_cuda
        and capability(x.device)[0] == 9
        and all(_tma_ready(t) for t in (x, w, out))
    )


def _tma_ready(t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """The compute capability whose plans a matmul on `device` takes. Tensors off the GPU only reach the kernels
    under Triton's interpreter, which follows Hopper's plans."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
