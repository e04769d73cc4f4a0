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
Swapped tiles (`MatmulTile.swap`), the operands' roles exchanged, are matmul_gluon_swapped.py's, built on the
helpers here; matmul_gluon_launch.py launches them all.

The arithmetic is the `tl.dot` tiles' to the bit, for the reasons matmul_plans.py gives: each slice of K is one
chain of `wgmma` steps of K = 16 in K order into an fp32 accumulator whose first step adds to nothing (as Triton
starts a zeroed accumulator), and a program's slices are added in slice order, the first taken as it is. The
tuner and the GPU tests prove it as they prove every tile (tuner.py, tests/test_kernels_triton_gluon.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ._compat import HAVE_TRITON

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
    # Every warp of the program at one point: `gl.barrier` from Triton 3.7 on, `gl.thread_barrier` in 3.6, which
    # older CUDA builds of torch install (the stack names the Triton version, so a replay runs under the same one).
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

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
        # copies ran slower on an H200. The rows it shares with the tile before go
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
            _cta_barrier()
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
                    _cta_barrier()
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


def _shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _descriptor(t: torch.Tensor, block: list[int]) -> Any:
    return TensorDescriptor.from_tensor(t, block, _shared_layout(block, t.dtype))
