"""Swapped Gluon matmul tiles for Hopper: out.T = w @ x.T, the weight's rows the tensor cores' rows and x's rows
their columns, which come in multiples of 8, so a tile's rows of x may be a main block and a tail
(`MatmulTile.tail`) that fit M closely (M = 264 in three tiles of 64 + 32 rows, not five of 64). Two kernels:
- `_swapped_kernel`: matmul_gluon.py's `pipelined` or `persistent` kernel with the roles exchanged, or with a slice
  of K in each of several programs;
- `_swapped_specialized_kernel`: a warpgroup of its own for each 64 weight rows and a copying warp, so that a tile
  may have 192 weight rows in 12 multiplying warps, where a program's `num_warps` must be a power of two.
Their arithmetic is matmul_gluon.py's, to the bit: the same chains of `wgmma` steps in K order, slices added in
slice order.
"""

from __future__ import annotations

from .matmul_gluon import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .matmul_gluon import (
        _acc_layout,
        _ahead_origin,
        _allocate_ring,
        _cta_barrier,
        _program_walk,
        _start_as_dependent,
        _sum_partials,
        _tile_origin,
    )

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
            _cta_barrier()
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
                    _cta_barrier()
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
