"""What decides the GPU matmul's bits and what decides only its speed: reduction orders, tiles and plans.

Two things are kept apart here, because only one of them decides a result's bits:
- The reduction order, `MatmulPlan.split_k`, a function of the weight's shape (N, K) alone. K is cut into `split_k`
  equal slices; each slice is reduced from zero by one chain of tensor-core steps of 16 elements of K, in K order,
  and the slices' fp32 sums are added in slice order 0, 1, 2, ... (the first slice's sum taken as it is).
- The tiling, `MatmulTile`, which may follow M: the tile's rows and columns, how much of K one loop step loads,
  the warps and the pipeline depth, and whether a slice runs in its own program (fp32 partials, added in slice
  order by the last of the tile's programs to finish) or after the previous slice inside one program, and whether
  operands arrive through plain loads or the tensor-memory engine (TMA, which pays from a few hundred rows on),
  and whether a `tl.dot` kernel runs the tile or one of the Gluon kernels written below it (matmul_gluon.py).
  None of these changes the chain a row goes through: every tile issues the same Hopper `wgmma` steps of K = 16
  for the same operand values, a K step of 64 is four of them and of 128 eight, and slices meet in the same order
  either way. So small M gets narrow tiles (enough programs to keep weight bytes in flight) and large M wide ones,
  with one set of bits for every M.

That equivalence is a claim about the hardware and the compiler, so it is proven rather than assumed: on the GPU,
every tile of a plan is checked bit-identical to every other at every M = 1..512 and at shifted row windows
(`tests/test_kernels_triton.py`, `bench/gpu_kernels.py`). Tiles are kept to `wgmma`'s shapes (64, 128 or 256 rows,
4 or 8 warps), so no tile falls back to the older `mma` instruction, whose internal sums could differ. A swapped
tile computes out.T = w @ x.T, the weight's rows in that role; the sweep proved that the tensor cores' sum of a
16-wide step does not depend on which operand is which. All of this was proven on Hopper (an H200) only: an older
GPU runs every tile on `mma`, where tiles may follow M only once a sweep there has proven them.

`TUNED` holds the plans measured best for the weights of the models we serve; other shapes get `rule_plan`.
The kernels that run the tiles are in matmul.py. This module knows nothing of models, of scheduling, or of Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The tensor cores' K step for 16-bit operands; the reduction chain is made of these whatever the tile.
INSTRUCTION_K = 16
_WGMMA_ROWS = (64, 128, 256)
_WGMMA_WARPS = (4, 8)
_SWAP_MIN_COLS = 16
_GLUON_KERNELS = ("", "specialized", "pipelined", "persistent")
# A Hopper program's shared memory, and the fp32 accumulator registers a thread of a Gluon tile may hold (a
# 128 x 256 tile over 8 warps; more spills, compiled for sm_90a).
_SHARED_BYTES = 227 * 1024
_GLUON_ACCUMULATOR_REGISTERS = 128
# The narrowest wgmma step a Gluon tile's warpgroup may take (its columns); narrower ones do not compile.
_GLUON_MIN_WGMMA_COLS = 16
# A swapped `specialized` Gluon tile's weight rows come in partitions of one warpgroup each, this many rows apiece,
# up to four of them: a warpgroup's wgmma steps take 64 rows, and a program of five warpgroups (a copying warp's
# among them) leaves each thread 102 registers.
SWAPPED_PARTITION_ROWS = 64
_SWAPPED_PARTITIONS = (1, 2, 3, 4)
# Registers a thread of a Gluon tile needs beside its accumulators (addresses, counters, barriers' phases); a
# 3-partition tile with 96 accumulator registers a thread compiled to 128 without spilling, for sm_90a.
_GLUON_OTHER_REGISTERS = 32
# Without a split, fewer programs than this leave multiprocessors idle at decode sizes (an H200 has 132).
_TARGET_PROGRAMS = 128


@dataclass(frozen=True)
class MatmulTile:
    """How one launch cuts the work. Free to follow M: it never changes a row's reduction order."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # A slice of K per program (fp32 partials, added in slice order by the tile's last program to finish) rather than
    # all slices in one program.
    split_programs: bool = False
    # Operands copied by the tensor-memory engine (TMA) rather than by per-thread loads.
    tma: bool = False
    # The weight's rows as the tensor cores' rows and x's rows as their columns (out.T = w @ x.T): the columns of a
    # wgmma step come in multiples of 8, so a tile may then hold 16 or 32 of x's rows, not 64 or more.
    swap: bool = False
    # Swapped tiles only: a second block of this many of x's rows after the main one, against the same weight tile.
    tail: int = 0
    # Up to one program per multiprocessor, in groups of one program per row tile, each taking an equal run of its
    # row tile's (column tile, slice, K step) units, a chain cut between two programs carrying its fp32
    # accumulator from one to the next (`_matmul_stream_kernel`).
    stream: bool = False
    # Run by a Gluon kernel written below `tl.dot` (matmul_gluon.py): "specialized", "pipelined" or "persistent";
    # "" for the `tl.dot` kernels. Operands arrive through the tensor-memory engine whatever `tma` says. A swapped
    # "specialized" tile has a partition of 4 warps for each 64 of its weight rows (so 192 rows take 12 warps, where
    # `num_warps` alone must be a power of two), and its programs walk tiles as persistent ones do.
    gluon: str = ""

    def tiles(self, m: int, n: int) -> int:
        """How many tiles cover an [M, N] output: blocks of x's rows (main block and tail) by blocks of w's."""
        return -(-m // (self.block_m + self.tail)) * -(-n // self.block_n)

    @property
    def partitions(self) -> int:
        """The warpgroups of a swapped `specialized` Gluon tile, each multiplying its own 64 weight rows; else 0."""
        return -(-self.block_n // SWAPPED_PARTITION_ROWS) if self.swap and self.gluon == "specialized" else 0

    def check(self) -> None:
        rows, cols = (self.block_n, self.block_m) if self.swap else (self.block_m, self.block_n)
        if self.partitions:
            if (
                self.block_n % SWAPPED_PARTITION_ROWS
                or self.partitions not in _SWAPPED_PARTITIONS
                or self.num_warps != 4
                or self.split_programs
            ):
                raise ValueError(
                    f"{self}: a swapped specialized Gluon tile has 64, 128, 192 or 256 weight rows, a warpgroup of"
                    " 4 warps for each 64, and every slice of K in one program"
                )
        elif rows not in _WGMMA_ROWS or self.num_warps not in _WGMMA_WARPS:
            raise ValueError(f"{self}: tiles must have 64, 128 or 256 rows and 4 or 8 warps (wgmma shapes)")
        if self.swap and (cols < _SWAP_MIN_COLS or self.tma):
            raise ValueError(
                f"{self}: a swapped tile takes {_SWAP_MIN_COLS} or more of x's rows, and plain loads"
            )
        if self.tail and (not self.swap or self.tail < _SWAP_MIN_COLS or self.tail & (self.tail - 1)):
            raise ValueError(
                f"{self}: a tail is for swapped tiles, a power of two of {_SWAP_MIN_COLS} rows or more"
            )
        if self.block_k % INSTRUCTION_K:
            raise ValueError(f"{self}: the K step must be a multiple of {INSTRUCTION_K}")
        if self.stream and (self.swap or self.split_programs):
            raise ValueError(f"{self}: a streamed tile is not swapped, and its programs already cut K")
        if self.gluon not in _GLUON_KERNELS:
            raise ValueError(f"{self}: gluon must be one of {_GLUON_KERNELS}")
        if self.gluon and (self.stream or (not self.swap and self.block_m not in (64, 128))):
            raise ValueError(f"{self}: a Gluon tile is not streamed, and unswapped has 64 or 128 rows of x")
        if self.gluon == "persistent" and self.split_programs:
            raise ValueError(
                f"{self}: a persistent Gluon program walks whole tiles, every slice of K in one program"
            )
        if self.gluon and _gluon_shared_bytes(self) > _SHARED_BYTES:
            raise ValueError(
                f"{self}: its stages and its output tile need more than {_SHARED_BYTES} bytes of shared memory"
            )
        if self.gluon and self.num_stages < 2:
            raise ValueError(f"{self}: a Gluon tile copies ahead into a ring of 2 or more stages")
        if self.gluon and gluon_wgmma_cols(self) < _GLUON_MIN_WGMMA_COLS:
            raise ValueError(
                f"{self}: its warpgroups would take wgmma steps {gluon_wgmma_cols(self)} columns wide, under"
                f" {_GLUON_MIN_WGMMA_COLS}"
            )


@dataclass(frozen=True)
class MatmulPlan:
    """Everything that decides a weight's matmul: one reduction order, and the tile used up to each M."""

    split_k: int
    # (largest M, tile), ascending in M; the last tile serves every larger M too.
    tiles: tuple[tuple[int, MatmulTile], ...]

    def tile_for(self, m: int) -> MatmulTile:
        for max_m, tile in self.tiles:
            if m <= max_m:
                return tile
        return self.tiles[-1][1]

    def spliced(self, inner: MatmulPlan, low: int, high: int) -> MatmulPlan:
        """This plan with `inner`'s tiles for M = low..high; both must reduce in one order."""
        if inner.split_k != self.split_k:
            raise ValueError(f"{inner} reduces K in {inner.split_k} slices, this plan in {self.split_k}")
        ends = sorted({low - 1, high} | {max_m for max_m, _ in self.tiles + inner.tiles})
        chosen: list[tuple[int, MatmulTile]] = []
        for end in (end for end in ends if end >= 1):
            tile = (inner if low <= end <= high else self).tile_for(end)
            if chosen and chosen[-1][1] == tile:
                chosen[-1] = (end, tile)
            else:
                chosen.append((end, tile))
        chosen[-1] = (LARGE_M, chosen[-1][1])
        return MatmulPlan(self.split_k, tuple(chosen))

    def check(self, k: int) -> None:
        """Raise unless every tile reduces K in this plan's one order. A ragged end of K (zero-padded loads) is
        allowed only to a plan of one `tl.dot` tile and one slice: padding steps of different tiles would differ."""
        for _, tile in self.tiles:
            tile.check()
        for _, tile in self.tiles:
            if not tile.gluon:
                continue
            # Each slice's accumulator and, past a program's first slice, the running total, in the threads'
            # registers.
            slices = 1 if tile.split_programs else self.split_k
            registers = (tile.block_m + tile.tail) * tile.block_n * min(slices, 2) // (32 * tile.num_warps)
            limit = _GLUON_ACCUMULATOR_REGISTERS
            if tile.partitions:
                # Each warpgroup holds its own 64 weight rows' accumulators, within its even share of the registers.
                registers //= tile.partitions
                share = 65536 // (32 * 4 * (tile.partitions + 1))
                limit = min(limit, share - _GLUON_OTHER_REGISTERS)
            if registers > limit:
                raise ValueError(
                    f"{tile}: {slices} slices' accumulators take {registers} registers a thread, over {limit}"
                )
            # A persistent program copies its first stages before it has worked out where its second tile is.
            if k // tile.block_k < tile.num_stages - 1:
                raise ValueError(
                    f"{tile}: a Gluon tile needs at least {tile.num_stages - 1} K steps, K = {k}"
                )
        ragged = any(k % (self.split_k * tile.block_k) for _, tile in self.tiles)
        # Streamed and Gluon tiles walk whole K steps only.
        if ragged and (
            self.split_k > 1 or len(self.tiles) > 1 or self.tiles[0][1].stream or self.tiles[0][1].gluon
        ):
            raise ValueError(f"{self}: every K step must divide each of the {self.split_k} slices of K = {k}")


def gluon_wgmma_cols(tile: MatmulTile) -> int:
    """The columns of the narrowest wgmma step of a Gluon tile's warpgroup: warps stack along the tile's rows, 16 to
    a warp, and those left over split its columns (matmul_gluon.py). Swapped, the rows are the weight's, and x's main
    block and its tail are each a step's columns."""
    rows, cols = (
        (tile.block_n, min(tile.block_m, tile.tail or tile.block_m))
        if tile.swap
        else (tile.block_m, tile.block_n)
    )
    warps_m = min(tile.num_warps, rows // 16)
    return min(256, cols // (tile.num_warps // warps_m))


def _gluon_shared_bytes(tile: MatmulTile) -> int:
    """Shared memory a Gluon tile takes in 16-bit operands: its ring of stages and its output tile."""
    rows = tile.block_m + tile.tail
    return ((rows + tile.block_n) * tile.block_k * tile.num_stages + rows * tile.block_n) * 2


def _tile(
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
    split_programs: bool = False,
    tma: bool = False,
    swap: bool = False,
    tail: int = 0,
    stream: bool = False,
    gluon: str = "",
) -> MatmulTile:
    return MatmulTile(bm, bn, bk, warps, stages, split_programs, tma, swap, tail, stream, gluon)


LARGE_M = 1 << 62

# (N, K) -> plan for Qwen3-1.7B's weights, from `bench/gpu_kernels.py` on an H200 (bench/results/h200.md): for each
# reduction order, the fastest proven tile at each timed M, up to that M, and the order whose worst ratio to cuBLAS is
# smallest. The tiles at M = 129..512 are run 73's (the down projection's run 76's), swept there alone
# (`--within=129:512`) against the tiles the plans held, once swapped Gluon tiles could take a warpgroup for each 64
# weight rows; gate_up's at 289..352 and o_proj's at 257..304 are run 82's, swept there under Triton 3.7. At M <= 128
# the plans keep runs 57's and 58's: run 62's, faster alone, slowed the decode step (run 64). Past M = 512 every
# weight keeps the tiles that run 59 measured end to end: the sweep picks those from one timing each at M = 2048 and
# 8192, too little to choose between tiles a few percent apart (run 58's, so chosen, prefilled 3% slower). Tiles
# compete on GPU time alone: the backend replays its steps from CUDA graphs (step_graphs.py), so a TMA tile's host
# cost (two descriptors a launch, up to 150 us) never reaches a served step, though it makes an eager step of one
# prompt wait on the host. The down projection keeps at least two slices of K: with K whole it is 1.3x of cuBLAS at
# decode sizes, and measured end to end that lost more decode (0.93-0.97 of default) than it won prefill
# (bench/results/h200.md).
TUNED: dict[tuple[int, int], MatmulPlan] = {
    (2048, 2048): MatmulPlan(
        1,
        (
            (64, _tile(16, 64, 128, 4, 6, swap=True)),
            (128, _tile(32, 64, 128, 4, 6, swap=True)),
            (256, _tile(64, 64, 64, 4, 8, gluon="specialized")),
            (288, _tile(64, 64, 64, 4, 10, swap=True, tail=32, gluon="specialized")),
            (304, _tile(64, 64, 64, 4, 11, swap=True, tail=16, gluon="specialized")),
            (384, _tile(64, 64, 128, 4, 5, swap=True, tail=32, gluon="persistent")),
            (448, _tile(64, 128, 64, 4, 8, swap=True, gluon="specialized")),
            (480, _tile(64, 128, 128, 4, 4, gluon="pipelined")),
            (496, _tile(64, 128, 64, 4, 8, swap=True, gluon="specialized")),
            (512, _tile(64, 128, 128, 4, 4, gluon="pipelined")),
            (2048, _tile(128, 256, 64, 8, 3, gluon="specialized")),
            (LARGE_M, _tile(128, 256, 64, 8, 3, gluon="persistent")),
        ),
    ),
    (4096, 2048): MatmulPlan(
        1,
        (
            (32, _tile(16, 64, 128, 4, 6, swap=True)),
            (64, _tile(32, 64, 128, 4, 6, swap=True)),
            (96, _tile(64, 64, 128, 4, 4)),
            (128, _tile(64, 64, 64, 4, 8, gluon="specialized")),
            (192, _tile(64, 64, 128, 4, 5, swap=True, tail=32, gluon="pipelined")),
            (256, _tile(64, 128, 128, 4, 4, gluon="persistent")),
            (272, _tile(128, 64, 128, 4, 4, swap=True, tail=16, gluon="pipelined")),
            (288, _tile(128, 64, 128, 4, 4, swap=True, tail=16, gluon="persistent")),
            (320, _tile(64, 128, 64, 4, 7, swap=True, tail=16, gluon="specialized")),
            (384, _tile(64, 128, 64, 4, 7, swap=True, tail=32, gluon="specialized")),
            (512, _tile(128, 128, 64, 4, 6, swap=True, gluon="specialized")),
            (2048, _tile(128, 128, 64, 8, 3, tma=True)),
            (LARGE_M, _tile(128, 256, 64, 8, 3, gluon="persistent")),
        ),
    ),
    (12288, 2048): MatmulPlan(
        1,
        (
            (8, _tile(64, 64, 64, 4, 6)),
            (16, _tile(64, 128, 64, 4, 6, swap=True)),
            (32, _tile(64, 128, 64, 4, 6)),
            (64, _tile(64, 128, 64, 4, 6, gluon="persistent")),
            (96, _tile(128, 128, 64, 8, 5)),
            (128, _tile(128, 128, 64, 8, 5, tma=True)),
            (144, _tile(128, 128, 64, 4, 5, swap=True, tail=16, gluon="specialized")),
            (160, _tile(128, 128, 64, 4, 5, swap=True, tail=32, gluon="specialized")),
            (192, _tile(64, 192, 64, 4, 5, swap=True, tail=32, gluon="specialized")),
            (256, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (288, _tile(128, 192, 64, 4, 4, swap=True, tail=16, gluon="specialized")),
            (304, _tile(64, 128, 64, 4, 7, swap=True, tail=16, gluon="specialized")),
            (320, _tile(64, 192, 64, 4, 5, swap=True, tail=16, gluon="specialized")),
            (352, _tile(64, 192, 64, 4, 6, swap=True, gluon="specialized")),
            (384, _tile(64, 192, 64, 4, 5, swap=True, tail=32, gluon="specialized")),
            (416, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (448, _tile(64, 128, 64, 4, 6, swap=True, tail=64, gluon="specialized")),
            (496, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (512, _tile(64, 128, 64, 4, 6, swap=True, tail=64, gluon="specialized")),
            (2048, _tile(128, 128, 64, 8, 3, tma=True)),
            (LARGE_M, _tile(128, 256, 64, 8, 3, gluon="persistent")),
        ),
    ),
    (151936, 2048): MatmulPlan(
        1,
        (
            (8, _tile(16, 64, 128, 4, 6, swap=True)),
            (32, _tile(32, 128, 128, 4, 4, swap=True)),
            (96, _tile(64, 128, 128, 4, 4, gluon="persistent")),
            (128, _tile(128, 128, 64, 8, 5, gluon="persistent")),
            (144, _tile(128, 128, 64, 4, 5, swap=True, tail=16, gluon="specialized")),
            (160, _tile(128, 128, 64, 4, 5, swap=True, tail=32, gluon="specialized")),
            (192, _tile(128, 128, 64, 4, 4, swap=True, tail=64, gluon="specialized")),
            (200, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (256, _tile(128, 128, 64, 4, 6, swap=True, gluon="specialized")),
            (288, _tile(128, 192, 64, 4, 4, swap=True, tail=16, gluon="specialized")),
            (320, _tile(128, 128, 64, 4, 5, swap=True, tail=32, gluon="specialized")),
            (384, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (416, _tile(128, 192, 64, 4, 4, swap=True, tail=16, gluon="specialized")),
            (512, _tile(128, 192, 64, 4, 4, swap=True, gluon="specialized")),
            (LARGE_M, _tile(128, 256, 64, 8, 3, gluon="persistent")),
        ),
    ),
    (2048, 6144): MatmulPlan(
        2,
        (
            (32, _tile(16, 64, 128, 4, 6, split_programs=True, swap=True)),
            (64, _tile(64, 32, 128, 4, 6, split_programs=True)),
            (128, _tile(64, 64, 64, 4, 8, split_programs=True, gluon="specialized")),
            (192, _tile(64, 64, 64, 4, 13, swap=True, gluon="specialized")),
            (256, _tile(64, 64, 64, 4, 8, gluon="specialized")),
            (288, _tile(64, 64, 64, 4, 10, swap=True, tail=32, gluon="specialized")),
            (304, _tile(64, 64, 64, 4, 11, swap=True, tail=16, gluon="specialized")),
            (384, _tile(64, 64, 64, 4, 10, swap=True, tail=32, gluon="specialized")),
            (448, _tile(64, 128, 64, 4, 8, swap=True, gluon="specialized")),
            (464, _tile(64, 128, 128, 4, 4, gluon="persistent")),
            (496, _tile(64, 128, 128, 4, 4, gluon="pipelined")),
            (512, _tile(64, 128, 128, 4, 4, gluon="persistent")),
            (LARGE_M, _tile(128, 128, 64, 8, 5, tma=True)),
        ),
    ),  # down
}


def rule_plan(n: int, k: int) -> MatmulPlan:
    """A plan for any (N, K): no split of K, narrow tiles while M is small so that N alone
    gives the chip enough programs, wide tiles once M is large enough to be bound by arithmetic."""
    block_k = 64 if k % 64 == 0 else INSTRUCTION_K if k % INSTRUCTION_K == 0 else 0
    if block_k == 0:
        return MatmulPlan(1, ((LARGE_M, _tile(64, 64, 64, 4, 4)),))
    narrow = 128
    while narrow > 16 and -(-n // narrow) < _TARGET_PROGRAMS:
        narrow //= 2
    return MatmulPlan(
        1,
        (
            (64, _tile(64, narrow, block_k, 4, 4)),
            (256, _tile(64, 128, block_k, 4, 4)),
            (LARGE_M, _tile(128, 128, block_k, 8, 3)),
        ),
    )


# Compute capabilities on which `bench/gpu_kernels.py` proved that tiles may follow M: Hopper (H100, H200).
PROVEN_CAPABILITIES = frozenset({(9, 0)})


@functools.cache
def matmul_plan(n: int, k: int, capability: tuple[int, int]) -> MatmulPlan:
    """The one plan used for a weight of shape (N, K) on a GPU of `capability`, whatever the number of rows.

    Where no sweep has proven that tiles give the same bits (another instruction set may sum a step otherwise), the
    plan is one plain tile for every M: invariant by construction, slower at decode sizes."""
    plan = TUNED.get((n, k)) or rule_plan(n, k)
    last = plan.tiles[-1][1]
    if capability not in PROVEN_CAPABILITIES and (
        len(plan.tiles) > 1 or last.tma or last.swap or last.stream or last.gluon
    ):
        block_k = last.block_k
        plan = MatmulPlan(plan.split_k, ((LARGE_M, _tile(128, 128, block_k, 8, 2)),))
    plan.check(k)
    return plan
