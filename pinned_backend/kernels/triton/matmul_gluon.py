"""Matmul tiles for Hopper written in Gluon, below `tl.dot`: `x [M, K] @ w[N, K].T -> [M, N]`, bf16 or fp16 in.

Triton's `tl.dot` kernels (matmul.py) leave their copies' schedule, their store and their programs' lifetime to
the compiler. Here they are written out by hand, three ways a plan may choose by M (`MatmulTile.gluon`):
- `specialized`: one program per tile; one warp only issues tensor-memory-engine copies into a ring of
  shared-memory stages, and the other warps only issue `wgmma` steps, each freeing the stage of the step before;
- `pipelined`: one program per tile; the warps that multiply fill the ring `DEPTH - 1` steps ahead themselves;
- `persistent`: `pipelined` with at most one program per multiprocessor, each walking several tiles, its copies
  running on into the next tile while it finishes and stores the current one.
Each tile leaves through shared memory and the tensor-memory engine, which overlaps the store with what follows.
With `MatmulTile.split_programs`, `specialized` and `pipelined` run each slice of K in a program of its own, which
leaves its fp32 partial for the tile's last program to add in slice order, as matmul.py's tiled kernel does. A
part-empty last row tile moves back to end at row M, so that no copy of x reads past its end.
A swapped tile (`MatmulTile.swap`) runs `pipelined` or `persistent` with the operands' roles exchanged
(`_swapped_kernel`): the weight's rows are the tensor cores' rows, and x's rows their columns, which come in
multiples of 8, so a tile's rows of x may be a main block and a tail (`MatmulTile.tail`) that fit M closely.

The arithmetic is the `tl.dot` tiles' to the bit, for the reasons matmul_plans.py gives: each slice of K is one
chain of `wgmma` steps of K = 16 in K order into an fp32 accumulator whose first step adds to nothing (as Triton
starts a zeroed accumulator), and a program's slices are added in slice order, the first taken as it is. The
sweep and the GPU tests prove it as they prove every tile (bench/results/h200.md, "Below tl.dot").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._compat import HAVE_TRITON
from .dependent_launch import launch_options
from .matmul_plans import SWAPPED_PARTITION_ROWS, MatmulTile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = HAVE_TRITON
except ImportError:
    HAVE_GLUON = False

if HAVE_GLUON:

    @gluon.jit
    def _tile_origin(tile, M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, N_TILES: gl.constexpr,
                     GROUP_M: gl.constexpr):  # fmt: skip
        # The tiled kernel's launch order (matmul.py): bands of GROUP_M row tiles, row tiles fastest in a band.
        num_m = gl.cdiv(M, BLOCK_M)
        band = tile // (GROUP_M * N_TILES)
        first_m = band * GROUP_M
        band_rows = gl.minimum(num_m - first_m, GROUP_M)
        in_band = tile % (GROUP_M * N_TILES)
        # A part-empty last row tile moves back to end at row M, so that no copy of x reaches past its end: such
        # copies ran slower (bench/results/h200.md, runs 55 and 57). The rows it shares with the tile before go
        # through the same chains there and here, so both programs write them with the same bits.
        row = gl.minimum((first_m + in_band % band_rows) * BLOCK_M, gl.maximum(M - BLOCK_M, 0))
        return row, (in_band // band_rows) * BLOCK_N

    @gluon.jit
    def _program_walk(
        M, ROWS: gl.constexpr, N_TILES: gl.constexpr, STEPS: gl.constexpr, BLOCK_K: gl.constexpr
    ):
        """A program's walk over the launch's tiles of ROWS rows of x: tiles first, first + programs, ... of the launch
        order, so that the programs running at once share weight tiles through L2, and its K steps counted over all
        of them. With a slice of K in each of several programs (never persistent), its slice starts at `k_base`."""
        first = gl.program_id(0)
        programs = gl.num_programs(0)
        my_tiles = gl.cdiv(gl.cdiv(M, ROWS) * N_TILES - first, programs)
        k_base = gl.program_id(1) * STEPS * BLOCK_K
        return first, programs, my_tiles, my_tiles * STEPS, k_base

    @gluon.jit
    def _ahead_origin(
        ahead, ahead_tile, ahead_m, ahead_n, first, programs, M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        N_TILES: gl.constexpr, GROUP_M: gl.constexpr, STEPS: gl.constexpr,
    ):  # fmt: skip
        """The tile of a program's step `ahead` (counted over all its tiles) and that tile's origin: worked out again
        only when the step crosses into another tile, not once a step."""
        if ahead // STEPS != ahead_tile:
            ahead_tile = ahead // STEPS
            ahead_m, ahead_n = _tile_origin(
                first + ahead_tile * programs, M, BLOCK_M, BLOCK_N, N_TILES, GROUP_M
            )
        return ahead_tile, ahead_m, ahead_n

    @gluon.constexpr_function
    def _acc_layout(block_m: int, block_n: int, num_warps: int) -> Any:
        # Warps stacked along the tile's rows, 16 to a warp: a warpgroup's wgmma steps each cover 64 rows and up
        # to 256 columns (matmul_plans.gluon_wgmma_cols, which the plans' checks hold to 16 or more).
        warps_m = min(num_warps, block_m // 16)
        return gl.NVMMADistributedLayout(
            version=[3, 0],
            warps_per_cta=[warps_m, num_warps // warps_m],
            instr_shape=[16, min(256, block_n // (num_warps // warps_m)), 16],
        )

    @gluon.jit
    def _start_as_dependent(PDL: gl.constexpr):
        # dependent_launch.py's rule, in Gluon: let the next kernel launch, then wait for the one before.
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)  # fmt: skip

    @gluon.jit
    def _store_tile(total, out_desc, out_stage, off_m, off_n):
        # Through shared memory and the tensor-memory engine, which writes whole rows and leaves out those past M;
        # the stage is free again once the previous tile's copy out has read it.
        tma.store_wait(0)
        out_stage.store(total.to(out_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_stage)

    @gluon.jit
    def _allocate_ring(x_desc, w_desc, out_desc, DEPTH: gl.constexpr):
        """Shared memory for a ring of DEPTH stages of x's and w's K steps, each with a barrier its copies fill, and
        for the output tile on its way out."""
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        x_stages = gl.allocate_shared_memory(
            x_desc.dtype, [DEPTH, x_desc.block_type.shape[0], block_k], x_desc.layout
        )
        w_stages = gl.allocate_shared_memory(
            w_desc.dtype, [DEPTH, w_desc.block_type.shape[0], block_k], w_desc.layout
        )
        filled = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        out_stage = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
        for i in gl.static_range(DEPTH):
            mbarrier.init(filled.index(i), count=1)
        return x_stages, w_stages, filled, out_stage

    @gluon.jit
    def _swapped_offsets(total, off_m, off_n, M, N):
        """Where a swapped accumulator's elements go in one slice's partials, and which are inside out: partials
        of swapped tiles are laid out [N, M], so that a thread's neighbouring columns are neighbours there too."""
        layout: gl.constexpr = total.type.layout
        w_rows = off_n + gl.arange(0, total.shape[0], layout=gl.SliceLayout(1, layout))
        x_rows = off_m + gl.arange(0, total.shape[1], layout=gl.SliceLayout(0, layout))
        offsets = w_rows.to(gl.int64)[:, None] * M + x_rows[None, :]
        return offsets, (w_rows < N)[:, None] & (x_rows < M)[None, :]

    @gluon.jit
    def _sum_partials(part_ptr, offsets, inside, block, PROGRAMS_K: gl.constexpr):
        # The others' partials were written on other multiprocessors: read past L1, which is not coherent.
        total = gl.load(part_ptr + offsets, mask=inside, other=0.0, cache_modifier=".cg")
        for s in gl.static_range(1, PROGRAMS_K):
            total += gl.load(part_ptr + s * block + offsets, mask=inside, other=0.0, cache_modifier=".cg")
        return total

    @gluon.jit
    def _finish_tile(
        total, out_desc, out_stage, part_ptr, arrivals_ptr, tile, off_m, off_n, M, N, PROGRAMS_K: gl.constexpr
    ):  # fmt: skip
        """Store a tile, or with a slice of K in each of `PROGRAMS_K` programs, leave this one's fp32 partial; the
        tile's last program to arrive adds them in slice order and stores the sum, as in matmul.py's tiled kernel."""
        if PROGRAMS_K == 1:
            _store_tile(total, out_desc, out_stage, off_m, off_n)
        else:
            layout: gl.constexpr = total.type.layout
            rows = off_m + gl.arange(0, total.shape[0], layout=gl.SliceLayout(1, layout))
            cols = off_n + gl.arange(0, total.shape[1], layout=gl.SliceLayout(0, layout))
            offsets = rows.to(gl.int64)[:, None] * N + cols[None, :]
            inside = (rows < M)[:, None] & (cols < N)[None, :]
            # Slice s's partials are the s-th [M, N] block.
            block = M.to(gl.int64) * N
            gl.store(part_ptr + gl.program_id(1) * block + offsets, total, mask=inside)
            # Every thread's partial before the arrival, which releases them to the program that sees the last one.
            gl.thread_barrier()
            arrived = gl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == PROGRAMS_K - 1:
                total = _sum_partials(part_ptr, offsets, inside, block, PROGRAMS_K)
                _store_tile(total, out_desc, out_stage, off_m, off_n)
                gl.store(arrivals_ptr + tile, 0)

    @gluon.jit
    def _copy_stages(
        x_desc, w_desc, x_stages, w_stages, filled, emptied, off_m, off_n, k_base, STEPS: gl.constexpr
    ):  # fmt: skip
        """The copying warp: K step i into stage i % depth, once the tensor cores have finished with that stage."""
        depth: gl.constexpr = x_stages.shape[0]
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        for i in range(STEPS):
            stage = i % depth
            # A fresh barrier counts as having completed the phase before its first: the first round waits on
            # nothing.
            mbarrier.wait(emptied.index(stage), ((i // depth) & 1) ^ 1)
            mbarrier.expect(filled.index(stage), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                x_desc, [off_m, k_base + i * block_k], filled.index(stage), x_stages.index(stage)
            )
            tma.async_copy_global_to_shared(
                w_desc, [off_n, k_base + i * block_k], filled.index(stage), w_stages.index(stage)
            )

    @gluon.jit
    def _multiply_stages(
        x_stages, w_stages, filled, emptied, out_desc, out_stage, part_ptr, arrivals_ptr, tile, off_m, off_n, M, N,
        SLICES: gl.constexpr, STEPS: gl.constexpr, PROGRAMS_K: gl.constexpr, acc_layout: gl.constexpr,
    ):  # fmt: skip
        """The tensor-core warps: each slice's chain of steps, the slices added in order, then the store."""
        depth: gl.constexpr = x_stages.shape[0]
        block_m: gl.constexpr = x_stages.shape[1]
        block_n: gl.constexpr = w_stages.shape[1]
        per_slice: gl.constexpr = STEPS // SLICES
        total = gl.zeros((block_m, block_n), gl.float32, acc_layout)
        for s in gl.static_range(SLICES):
            acc = gl.zeros((block_m, block_n), gl.float32, acc_layout)
            for j in range(per_slice):
                i = s * per_slice + j
                stage = i % depth
                mbarrier.wait(filled.index(stage), (i // depth) & 1)
                acc = warpgroup_mma(
                    x_stages.index(stage),
                    w_stages.index(stage).permute((1, 0)),
                    acc,
                    use_acc=j > 0,
                    is_async=True,
                )
                # At most this step in flight: the step before has read its stage, which goes back to the copier.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(emptied.index((i + depth - 1) % depth), pred=i > 0)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            total = acc if s == 0 else total + acc
        _finish_tile(total, out_desc, out_stage, part_ptr, arrivals_ptr, tile, off_m, off_n, M, N, PROGRAMS_K)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["M"])
    def _specialized_kernel(
        x_desc, w_desc, out_desc, part_ptr, arrivals_ptr, M, N,
        SLICES: gl.constexpr, STEPS: gl.constexpr, DEPTH: gl.constexpr, N_TILES: gl.constexpr,
        GROUP_M: gl.constexpr, PROGRAMS_K: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        block_m: gl.constexpr = x_desc.block_type.shape[0]
        block_n: gl.constexpr = w_desc.block_type.shape[0]
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        tile = gl.program_id(0)
        off_m, off_n = _tile_origin(tile, M, block_m, block_n, N_TILES, GROUP_M)
        # With a slice of K in each of PROGRAMS_K programs, this program's slice starts here.
        k_base = gl.program_id(1) * STEPS * block_k
        x_stages, w_stages, filled, out_stage = _allocate_ring(x_desc, w_desc, out_desc, DEPTH)
        # The tensor cores' warps give each stage back to the copying warp through its own barrier.
        emptied = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(DEPTH):
            mbarrier.init(emptied.index(i), count=1)
        _start_as_dependent(PDL)
        gl.warp_specialize(
            [
                (
                    _multiply_stages,
                    (x_stages, w_stages, filled, emptied, out_desc, out_stage, part_ptr, arrivals_ptr, tile, off_m,
                     off_n, M, N, SLICES, STEPS, PROGRAMS_K, _acc_layout(block_m, block_n, num_warps)),
                ),
                (
                    _copy_stages,
                    (x_desc, w_desc, x_stages, w_stages, filled, emptied, off_m, off_n, k_base, STEPS),
                ),
            ],
            [1],
            [24],
        )  # fmt: skip

    @gluon.jit
    def _copy_step(
        x_desc, w_desc, x_stages, w_stages, filled, step, off_m, off_n, k_base, STEPS: gl.constexpr
    ):  # fmt: skip
        depth: gl.constexpr = x_stages.shape[0]
        stage = step % depth
        k_at = k_base + step % STEPS * x_desc.block_type.shape[1]
        mbarrier.expect(filled.index(stage), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, k_at], filled.index(stage), x_stages.index(stage))
        tma.async_copy_global_to_shared(w_desc, [off_n, k_at], filled.index(stage), w_stages.index(stage))

    @gluon.jit(do_not_specialize=["M"])
    def _pipelined_kernel(
        x_desc, w_desc, out_desc, part_ptr, arrivals_ptr, M, N,
        SLICES: gl.constexpr, STEPS: gl.constexpr, DEPTH: gl.constexpr, N_TILES: gl.constexpr,
        GROUP_M: gl.constexpr, PROGRAMS_K: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        block_m: gl.constexpr = x_desc.block_type.shape[0]
        block_n: gl.constexpr = w_desc.block_type.shape[0]
        block_k: gl.constexpr = x_desc.block_type.shape[1]
        per_slice: gl.constexpr = STEPS // SLICES
        first, programs, my_tiles, my_steps, k_base = _program_walk(M, block_m, N_TILES, STEPS, block_k)
        x_stages, w_stages, filled, out_stage = _allocate_ring(x_desc, w_desc, out_desc, DEPTH)
        acc_layout: gl.constexpr = _acc_layout(block_m, block_n, num_warps)
        _start_as_dependent(PDL)

        off_m, off_n = _tile_origin(first, M, block_m, block_n, N_TILES, GROUP_M)
        for p in gl.static_range(DEPTH - 1):
            if p < my_steps:
                _copy_step(x_desc, w_desc, x_stages, w_stages, filled, p, off_m, off_n, k_base, STEPS)
        # Where the copies DEPTH - 1 steps ahead are: worked out once a tile, not once a step.
        ahead_tile = first * 0 + (DEPTH - 1) // STEPS
        ahead_m, ahead_n = _tile_origin(first + ahead_tile * programs, M, block_m, block_n, N_TILES, GROUP_M)
        total = gl.zeros((block_m, block_n), gl.float32, acc_layout)
        for t in range(my_tiles):
            for s in gl.static_range(SLICES):
                acc = gl.zeros((block_m, block_n), gl.float32, acc_layout)
                for j in range(per_slice):
                    step = t * STEPS + s * per_slice + j
                    stage = step % DEPTH
                    mbarrier.wait(filled.index(stage), (step // DEPTH) & 1)
                    acc = warpgroup_mma(
                        x_stages.index(stage), w_stages.index(stage).permute((1, 0)), acc, use_acc=j > 0,
                        is_async=True,
                    )  # fmt: skip
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    # Every warpgroup's step before this one has finished: its stage takes the copy DEPTH - 1 ahead.
                    gl.thread_barrier()
                    ahead = step + DEPTH - 1
                    if ahead < my_steps:
                        ahead_tile, ahead_m, ahead_n = _ahead_origin(
                            ahead, ahead_tile, ahead_m, ahead_n, first, programs, M, block_m, block_n, N_TILES,
                            GROUP_M, STEPS,
                        )  # fmt: skip
                        _copy_step(
                            x_desc, w_desc, x_stages, w_stages, filled, ahead, ahead_m, ahead_n, k_base, STEPS
                        )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                total = acc if s == 0 else total + acc
            tile = first + t * programs
            off_m, off_n = _tile_origin(tile, M, block_m, block_n, N_TILES, GROUP_M)
            _finish_tile(
                total, out_desc, out_stage, part_ptr, arrivals_ptr, tile, off_m, off_n, M, N, PROGRAMS_K
            )
        tma.store_wait(0)

    @gluon.jit
    def _copy_swapped_step(
        w_desc, x_desc, xt_desc, w_stages, x_stages, xt_stages, filled, step, off_m, off_n, k_base,
        STEPS: gl.constexpr, TAIL: gl.constexpr,
    ):  # fmt: skip
        """A swapped tile's K step `step` into its stage. A stage's weight rows may come as several blocks (one per
        partition of `_swapped_specialized_kernel`), stage s's in w_stages[s * blocks:(s + 1) * blocks]."""
        depth: gl.constexpr = x_stages.shape[0]
        blocks: gl.constexpr = w_stages.shape[0] // depth
        w_rows: gl.constexpr = w_desc.block_type.shape[0]
        block_k: gl.constexpr = w_desc.block_type.shape[1]
        stage = step % depth
        k_at = k_base + step % STEPS * block_k
        nbytes: gl.constexpr = blocks * w_desc.block_type.nbytes + x_desc.block_type.nbytes
        if TAIL > 0:
            mbarrier.expect(filled.index(stage), nbytes + xt_desc.block_type.nbytes)
        else:
            mbarrier.expect(filled.index(stage), nbytes)
        for b in gl.static_range(blocks):
            tma.async_copy_global_to_shared(
                w_desc, [off_n + b * w_rows, k_at], filled.index(stage), w_stages.index(stage * blocks + b)
            )
        tma.async_copy_global_to_shared(x_desc, [off_m, k_at], filled.index(stage), x_stages.index(stage))
        if TAIL > 0:
            tma.async_copy_global_to_shared(
                xt_desc, [off_m + x_desc.block_type.shape[0], k_at], filled.index(stage), xt_stages.index(stage)
            )  # fmt: skip

    @gluon.jit
    def _store_swapped(
        total, total_t, out_desc, outt_desc, out_stage, outt_stage, off_m, off_n, TAIL: gl.constexpr
    ):  # fmt: skip
        """`_store_tile` for a swapped tile's main block and its tail. The accumulators are out's blocks transposed,
        [weight rows, x's rows]: transposed in registers on their way to shared memory."""
        tma.store_wait(0)
        out_stage.store(gl.permute(total, (1, 0)).to(out_desc.dtype))
        if TAIL > 0:
            outt_stage.store(gl.permute(total_t, (1, 0)).to(outt_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_stage)
        if TAIL > 0:
            tma.async_copy_shared_to_global(
                outt_desc, [off_m + out_desc.block_type.shape[0], off_n], outt_stage
            )

    @gluon.jit
    def _finish_swapped(
        total, total_t, out_desc, outt_desc, out_stage, outt_stage, part_ptr, arrivals_ptr, tile, off_m, off_n, M,
        N, TAIL: gl.constexpr, PROGRAMS_K: gl.constexpr,
    ):  # fmt: skip
        """`_finish_tile` for a swapped tile, its main block and its tail."""
        if PROGRAMS_K == 1:
            _store_swapped(total, total_t, out_desc, outt_desc, out_stage, outt_stage, off_m, off_n, TAIL)
        else:
            block = M.to(gl.int64) * N
            mine = part_ptr + gl.program_id(1) * block
            offsets, inside = _swapped_offsets(total, off_m, off_n, M, N)
            gl.store(mine + offsets, total, mask=inside)
            if TAIL > 0:
                offsets_t, inside_t = _swapped_offsets(
                    total_t, off_m + out_desc.block_type.shape[0], off_n, M, N
                )
                gl.store(mine + offsets_t, total_t, mask=inside_t)
            gl.thread_barrier()
            arrived = gl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == PROGRAMS_K - 1:
                total = _sum_partials(part_ptr, offsets, inside, block, PROGRAMS_K)
                if TAIL > 0:
                    total_t = _sum_partials(part_ptr, offsets_t, inside_t, block, PROGRAMS_K)
                _store_swapped(total, total_t, out_desc, outt_desc, out_stage, outt_stage, off_m, off_n, TAIL)
                gl.store(arrivals_ptr + tile, 0)

    @gluon.jit
    def _swapped_step(w_rows, x_stage, xt_stage, acc, acc_t, j, TAIL: gl.constexpr):
        """One K step of a swapped tile's chains, its main block's and its tail's, against one weight stage. This
        step's groups may still run when it returns; the step before has read its stage."""
        acc = warpgroup_mma(w_rows, x_stage.permute((1, 0)), acc, use_acc=j > 0, is_async=True)
        if TAIL > 0:
            acc_t = warpgroup_mma(w_rows, xt_stage.permute((1, 0)), acc_t, use_acc=j > 0, is_async=True)
            acc, acc_t = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_t))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        return acc, acc_t

    @gluon.jit
    def _swapped_slice_sum(acc, acc_t, total, total_t, S: gl.constexpr, TAIL: gl.constexpr):
        """A swapped tile's slice S of K has ended: its chains' sums, main block and tail, added to the slices' before
        in slice order (the first taken as it is)."""
        if TAIL > 0:
            acc, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_t))
            total_t = acc_t if S == 0 else total_t + acc_t
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        total = acc if S == 0 else total + acc
        return total, total_t

    @gluon.jit(do_not_specialize=["M"])
    def _swapped_kernel(
        w_desc, x_desc, xt_desc, out_desc, outt_desc, part_ptr, arrivals_ptr, M, N,
        SLICES: gl.constexpr, STEPS: gl.constexpr, DEPTH: gl.constexpr, N_TILES: gl.constexpr,
        GROUP_M: gl.constexpr, TAIL: gl.constexpr, PROGRAMS_K: gl.constexpr, PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """`_pipelined_kernel` with the operands' roles swapped (out.T = w @ x.T): the weight's rows are the
        tensor cores' rows and x's rows their columns, which come in multiples of 8. So a tile's rows of x are a main
        block and an optional tail block of TAIL rows after it (M = 264 is three tiles of 64 + 32 rows, not five of
        64), each block its own chain of steps against the same weight stage. With a slice of K in each of
        PROGRAMS_K programs (never persistent), this program's slice starts at K step `program_id(1) * STEPS`."""
        block_m: gl.constexpr = x_desc.block_type.shape[0]
        block_n: gl.constexpr = w_desc.block_type.shape[0]
        block_k: gl.constexpr = w_desc.block_type.shape[1]
        chunk: gl.constexpr = block_m + TAIL
        per_slice: gl.constexpr = STEPS // SLICES
        first, programs, my_tiles, my_steps, k_base = _program_walk(M, chunk, N_TILES, STEPS, block_k)
        w_stages, x_stages, filled, out_stage = _allocate_ring(w_desc, x_desc, out_desc, DEPTH)
        # With no tail, x's stages stand in for the tail's, which nothing then reads.
        xt_stages = x_stages
        outt_stage = out_stage
        if TAIL > 0:
            xt_stages = gl.allocate_shared_memory(xt_desc.dtype, [DEPTH, TAIL, block_k], xt_desc.layout)
            outt_stage = gl.allocate_shared_memory(
                outt_desc.dtype, outt_desc.block_type.shape, outt_desc.layout
            )
        acc_layout: gl.constexpr = _acc_layout(block_n, block_m, num_warps)
        # With no tail, a tail's accumulators of 16 columns stand in, which nothing then reads.
        tail_cols: gl.constexpr = TAIL if TAIL > 0 else 16
        tail_layout: gl.constexpr = _acc_layout(block_n, tail_cols, num_warps)
        _start_as_dependent(PDL)

        off_m, off_n = _tile_origin(first, M, chunk, block_n, N_TILES, GROUP_M)
        for p in gl.static_range(DEPTH - 1):
            if p < my_steps:
                _copy_swapped_step(
                    w_desc, x_desc, xt_desc, w_stages, x_stages, xt_stages, filled, p, off_m, off_n, k_base, STEPS,
                    TAIL,
                )  # fmt: skip
        ahead_tile = first * 0 + (DEPTH - 1) // STEPS
        ahead_m, ahead_n = _tile_origin(first + ahead_tile * programs, M, chunk, block_n, N_TILES, GROUP_M)
        total = gl.zeros((block_n, block_m), gl.float32, acc_layout)
        total_t = gl.zeros((block_n, tail_cols), gl.float32, tail_layout)
        for t in range(my_tiles):
            for s in gl.static_range(SLICES):
                acc = gl.zeros((block_n, block_m), gl.float32, acc_layout)
                acc_t = gl.zeros((block_n, tail_cols), gl.float32, tail_layout)
                for j in range(per_slice):
                    step = t * STEPS + s * per_slice + j
                    stage = step % DEPTH
                    mbarrier.wait(filled.index(stage), (step // DEPTH) & 1)
                    acc, acc_t = _swapped_step(
                        w_stages.index(stage), x_stages.index(stage), xt_stages.index(stage), acc, acc_t, j, TAIL
                    )  # fmt: skip
                    gl.thread_barrier()
                    ahead = step + DEPTH - 1
                    if ahead < my_steps:
                        ahead_tile, ahead_m, ahead_n = _ahead_origin(
                            ahead, ahead_tile, ahead_m, ahead_n, first, programs, M, chunk, block_n, N_TILES,
                            GROUP_M, STEPS,
                        )  # fmt: skip
                        _copy_swapped_step(
                            w_desc, x_desc, xt_desc, w_stages, x_stages, xt_stages, filled, ahead, ahead_m, ahead_n,
                            k_base, STEPS, TAIL,
                        )  # fmt: skip
                total, total_t = _swapped_slice_sum(acc, acc_t, total, total_t, s, TAIL)
            tile = first + t * programs
            off_m, off_n = _tile_origin(tile, M, chunk, block_n, N_TILES, GROUP_M)
            _finish_swapped(
                total, total_t, out_desc, outt_desc, out_stage, outt_stage, part_ptr, arrivals_ptr, tile, off_m,
                off_n, M, N, TAIL, PROGRAMS_K,
            )  # fmt: skip
        tma.store_wait(0)

    @gluon.jit
    def _copy_swapped_stages(
        w_desc, x_desc, xt_desc, ring, walk, my_steps, k_base, CHUNK: gl.constexpr, N_TILES: gl.constexpr,
        GROUP_M: gl.constexpr, STEPS: gl.constexpr, TAIL: gl.constexpr,
    ):  # fmt: skip
        """The copying warp of `_swapped_specialized_kernel`: its program's K steps over all its tiles, each into its
        stage once every partition has finished with that stage."""
        w_stages, x_stages, xt_stages, filled, emptied = ring
        first, programs, _, M = walk
        depth: gl.constexpr = x_stages.shape[0]
        block_n: gl.constexpr = w_stages.shape[0] // depth * w_desc.block_type.shape[0]
        tile_at = first * 0
        off_m, off_n = _tile_origin(first, M, CHUNK, block_n, N_TILES, GROUP_M)
        for step in range(my_steps):
            stage = step % depth
            # A fresh barrier counts as having completed the phase before its first: the first round waits on
            # nothing.
            mbarrier.wait(emptied.index(stage), ((step // depth) & 1) ^ 1)
            tile_at, off_m, off_n = _ahead_origin(
                step, tile_at, off_m, off_n, first, programs, M, CHUNK, block_n, N_TILES, GROUP_M, STEPS
            )
            _copy_swapped_step(
                w_desc, x_desc, xt_desc, w_stages, x_stages, xt_stages, filled, step, off_m, off_n, k_base, STEPS,
                TAIL,
            )  # fmt: skip

    @gluon.jit
    def _multiply_swapped_rows(
        ring, outs, walk, PART: gl.constexpr, CHUNK: gl.constexpr, N_TILES: gl.constexpr, GROUP_M: gl.constexpr,
        SLICES: gl.constexpr, STEPS: gl.constexpr, TAIL: gl.constexpr,
    ):  # fmt: skip
        """Partition PART of `_swapped_specialized_kernel`: one warpgroup's chains for its 64 weight rows of each of
        its program's tiles, against all the tile's rows of x, and their store."""
        w_stages, x_stages, xt_stages, filled, emptied = ring
        out_desc, outt_desc, out_stages, outt_stages = outs
        first, programs, my_tiles, M = walk
        depth: gl.constexpr = x_stages.shape[0]
        parts: gl.constexpr = w_stages.shape[0] // depth
        rows: gl.constexpr = w_stages.shape[1]
        block_m: gl.constexpr = x_stages.shape[1]
        per_slice: gl.constexpr = STEPS // SLICES
        acc_layout: gl.constexpr = _acc_layout(rows, block_m, 4)
        tail_cols: gl.constexpr = TAIL if TAIL > 0 else 16
        tail_layout: gl.constexpr = _acc_layout(rows, tail_cols, 4)
        out_stage = out_stages.index(PART)
        outt_stage = outt_stages.index(PART)
        total = gl.zeros((rows, block_m), gl.float32, acc_layout)
        total_t = gl.zeros((rows, tail_cols), gl.float32, tail_layout)
        for t in range(my_tiles):
            for s in gl.static_range(SLICES):
                acc = gl.zeros((rows, block_m), gl.float32, acc_layout)
                acc_t = gl.zeros((rows, tail_cols), gl.float32, tail_layout)
                for j in range(per_slice):
                    step = t * STEPS + s * per_slice + j
                    stage = step % depth
                    mbarrier.wait(filled.index(stage), (step // depth) & 1)
                    acc, acc_t = _swapped_step(
                        w_stages.index(stage * parts + PART), x_stages.index(stage), xt_stages.index(stage), acc,
                        acc_t, j, TAIL,
                    )  # fmt: skip
                    # This partition's step before has read its stage: once every partition's has, the copier may
                    # refill it.
                    mbarrier.arrive(emptied.index((step + depth - 1) % depth), pred=step > 0)
                total, total_t = _swapped_slice_sum(acc, acc_t, total, total_t, s, TAIL)
            off_m, off_n = _tile_origin(first + t * programs, M, CHUNK, parts * rows, N_TILES, GROUP_M)
            _store_swapped(
                total, total_t, out_desc, outt_desc, out_stage, outt_stage, off_m, off_n + PART * rows, TAIL
            )
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["M"])
    def _swapped_specialized_kernel(
        w_desc, x_desc, xt_desc, out_desc, outt_desc, part_ptr, arrivals_ptr, M, N,
        SLICES: gl.constexpr, STEPS: gl.constexpr, DEPTH: gl.constexpr, N_TILES: gl.constexpr,
        GROUP_M: gl.constexpr, TAIL: gl.constexpr, PARTS: gl.constexpr, PDL: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """A swapped tile of PARTS x 64 weight rows, warp-specialised: PARTS partitions of one warpgroup each
        (`_multiply_swapped_rows`), each multiplying its own 64 weight rows against the stage's rows of x (a main
        block and a tail, as in `_swapped_kernel`), and a copying warp (`_copy_swapped_stages`) that refills a stage
        once all partitions have read it. A tile of 192 weight rows so takes three warpgroups, where a program's
        `num_warps` must be a power of two. Programs walk their tiles as persistent ones do; a tile's slices of K
        all run in its program."""
        block_m: gl.constexpr = x_desc.block_type.shape[0]
        rows: gl.constexpr = w_desc.block_type.shape[0]
        block_k: gl.constexpr = w_desc.block_type.shape[1]
        chunk: gl.constexpr = block_m + TAIL
        first, programs, my_tiles, my_steps, k_base = _program_walk(M, chunk, N_TILES, STEPS, block_k)
        w_stages = gl.allocate_shared_memory(w_desc.dtype, [DEPTH * PARTS, rows, block_k], w_desc.layout)
        x_stages = gl.allocate_shared_memory(x_desc.dtype, [DEPTH, block_m, block_k], x_desc.layout)
        filled = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        emptied = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(DEPTH):
            mbarrier.init(filled.index(i), count=1)
            mbarrier.init(emptied.index(i), count=PARTS)
        out_stages = gl.allocate_shared_memory(out_desc.dtype, [PARTS, block_m, rows], out_desc.layout)
        # With no tail, x's and out's stages stand in for the tail's, which nothing then reads.
        xt_stages = x_stages
        outt_stages = out_stages
        if TAIL > 0:
            xt_stages = gl.allocate_shared_memory(xt_desc.dtype, [DEPTH, TAIL, block_k], xt_desc.layout)
            outt_stages = gl.allocate_shared_memory(outt_desc.dtype, [PARTS, TAIL, rows], outt_desc.layout)
        _start_as_dependent(PDL)
        ring = (w_stages, x_stages, xt_stages, filled, emptied)
        outs = (out_desc, outt_desc, out_stages, outt_stages)
        walk = (first, programs, my_tiles, M)
        copying = (w_desc, x_desc, xt_desc, ring, walk, my_steps, k_base, chunk, N_TILES, GROUP_M, STEPS,
                   TAIL)  # fmt: skip
        # The default partition is the first warpgroup; warp_specialize takes a fixed list of partitions. The
        # register counts are each warp's even share of the register file, (PARTS + 1) warpgroups in all.
        if PARTS == 1:
            gl.warp_specialize(
                [(_multiply_swapped_rows, (ring, outs, walk, 0, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_copy_swapped_stages, copying)],
                [1],
                [24],
            )  # fmt: skip
        elif PARTS == 2:
            gl.warp_specialize(
                [(_multiply_swapped_rows, (ring, outs, walk, 0, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 1, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_copy_swapped_stages, copying)],
                [4, 1],
                [168, 24],
            )  # fmt: skip
        elif PARTS == 3:
            gl.warp_specialize(
                [(_multiply_swapped_rows, (ring, outs, walk, 0, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 1, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 2, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_copy_swapped_stages, copying)],
                [4, 4, 1],
                [128, 128, 24],
            )  # fmt: skip
        else:
            gl.warp_specialize(
                [(_multiply_swapped_rows, (ring, outs, walk, 0, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 1, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 2, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_multiply_swapped_rows, (ring, outs, walk, 3, chunk, N_TILES, GROUP_M, SLICES, STEPS, TAIL)),
                 (_copy_swapped_stages, copying)],
                [4, 4, 4, 1],
                [96, 96, 96, 24],
            )  # fmt: skip


def _shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t: torch.Tensor, block: list[int]) -> Any:
    return TensorDescriptor.from_tensor(t, block, _shared_layout(block, t.dtype))


@dataclass(frozen=True)
class GluonLaunch:
    """What a Gluon tile's launch is made of, but for its tensors and grid: the kernel, the operand ("x", "w" or
    "out") and block of each tensor descriptor it takes first, in order, its compile-time constants, and the register
    limit it is compiled with, if any. After the descriptors come the partials, the arrival counters, M and N."""

    kernel: Any
    descriptors: tuple[tuple[str, tuple[int, int]], ...]
    constants: dict[str, int]
    maxnreg: int | None = None


def gluon_launch(tile: MatmulTile, split: int, n: int, k: int, group_m: int, dependent: bool) -> GluonLaunch:
    """The launch of `tile` over a weight [N, K] reduced in `split` slices (see `launch_gluon`), as programmatic
    dependents or not."""
    programs_k = split if tile.split_programs else 1
    constants = {
        "SLICES": split // programs_k,
        "STEPS": k // programs_k // tile.block_k,
        "DEPTH": tile.num_stages,
        "N_TILES": -(-n // tile.block_n),
        "GROUP_M": group_m,
        "PROGRAMS_K": programs_k,
        "PDL": dependent,
        "num_warps": tile.num_warps,
    }
    if tile.swap and tile.gluon == "specialized":
        # Each partition copies, multiplies and stores its own 64 weight rows.
        tail = tile.tail or tile.block_m
        rows = SWAPPED_PARTITION_ROWS
        descriptors = (
            ("w", (rows, tile.block_k)),
            ("x", (tile.block_m, tile.block_k)),
            ("x", (tail, tile.block_k)),
            ("out", (tile.block_m, rows)),
            ("out", (tail, rows)),
        )
        del constants["PROGRAMS_K"]
        return GluonLaunch(
            _swapped_specialized_kernel,
            descriptors,
            {**constants, "TAIL": tile.tail, "PARTS": tile.block_n // rows},
        )
    if tile.swap:
        # With no tail, x's and out's main blocks stand in for the tail's, which the kernel then never uses.
        tail = tile.tail or tile.block_m
        descriptors = (
            ("w", (tile.block_n, tile.block_k)),
            ("x", (tile.block_m, tile.block_k)),
            ("x", (tail, tile.block_k)),
            ("out", (tile.block_m, tile.block_n)),
            ("out", (tail, tile.block_n)),
        )
        return GluonLaunch(_swapped_kernel, descriptors, {**constants, "TAIL": tile.tail})
    descriptors = (
        ("x", (tile.block_m, tile.block_k)),
        ("w", (tile.block_n, tile.block_k)),
        ("out", (tile.block_m, tile.block_n)),
    )
    if tile.gluon == "specialized":
        # The copying warp's group of four gives up all but 24 registers a thread to the others; a limit keeps all
        # the program's warps within the register file. With 4 multiplying warps none is needed, as every thread
        # may take ptxas's most, 255: the limit of 256 that Triton then sets for 8 warps is ignored (ptxas says so),
        # and the code is the one an explicit 256 gave.
        limit = 65536 // ((tile.num_warps + 4) * 32) // 8 * 8
        return GluonLaunch(_specialized_kernel, descriptors, constants, limit if limit < 255 else None)
    return GluonLaunch(_pipelined_kernel, descriptors, constants)


def launch_gluon(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    split: int,
    tile: MatmulTile,
    group_m: int,
    multiprocessors: int,
    partials: torch.Tensor,
    arrivals: torch.Tensor,
) -> None:
    """out = x @ w.T by the Gluon kernel `tile.gluon`, tiles in bands of `group_m` row tiles, a persistent launch on
    at most `multiprocessors` programs. A tile's `split` slices of K run in one program, or with
    `tile.split_programs` each in its own, which leaves its fp32 partial in `partials` [split, M, N] and counts its
    arrival in `arrivals` (a zeroed counter per tile, which the tile's last program zeroes again). The operands must
    be on a Hopper GPU, with non-empty rows the tensor-memory engine can address (matmul.py sees to both)."""
    (m, k), n = x.shape, w.shape[0]
    dependent = launch_options(x.device)
    launch = gluon_launch(tile, split, n, k, group_m, dependent["PDL"])
    tiles = -(-m // (tile.block_m + tile.tail)) * launch.constants["N_TILES"]
    walks = tile.gluon == "persistent" or tile.partitions > 0
    programs = min(tiles, multiprocessors) if walks else tiles
    operands = {"x": x, "w": w, "out": out}
    descriptors = [_descriptor(operands[name], list(block)) for name, block in launch.descriptors]
    registers = {"maxnreg": launch.maxnreg} if launch.maxnreg else {}
    launch.kernel[(programs, split if tile.split_programs else 1)](
        *descriptors,
        partials,
        arrivals,
        m,
        n,
        **launch.constants,
        launch_pdl=dependent["launch_pdl"],
        **registers,
    )
