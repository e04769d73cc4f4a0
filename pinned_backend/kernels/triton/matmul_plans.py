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
(`stackpin-backend tune` for the plans it writes, `tests/test_kernels_triton.py` for every plan). Tiles are kept to `wgmma`'s shapes (64, 128 or 256 rows,
4 or 8 warps), so no tile falls back to the older `mma` instruction, whose internal sums could differ. A swapped
tile computes out.T = w @ x.T, the weight's rows in that role; the proofs showed that the tensor cores' sum of a
16-wide step does not depend on which operand is which. All of this was proven on Hopper (an H200) only: an older
GPU runs every tile on `mma`, where tiles may follow M only once a tune there has proven them.

Plans tuned for a weight on one GPU under one Triton are data: plan files (plan_files.py), written and proven by
`stackpin-backend tune` (tuner.py); every other shape gets `rule_plan`. The kernels that run the tiles are in
matmul.py. This module knows nothing of models, of scheduling, of files, or of Triton.
"""

from __future__ import annotations

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


# Compute capabilities on which tiles were proven to give one another's bits at every M (`stackpin-backend tune`
# proves each plan it writes; the GPU tests prove the rule's): Hopper (H100, H200).
PROVEN_CAPABILITIES = frozenset({(9, 0)})
# K from which the rule cuts the reduction into slices: a weight of few rows and long K (a down projection) has too
# few tiles at decode sizes to stream its bytes from every multiprocessor, and its slices in programs of their own
# multiply them. Slices cost little where K stays long: each is still thousands of steps.
_LONG_K = 8192
_MAX_RULE_SLICES = 4
# Fewer programs than this leave multiprocessors idle at decode sizes (an H200 has 132).
_TARGET_PROGRAMS = 128
# The M up to which each of the rule's tiles serves, past decode sizes.
_RULE_BANDS = (64, 128, 256, 384, 512)


def rule_split(k: int) -> int:
    """The rule's reduction order for any weight of K columns: K in 1, 2 or 4 equal slices, by K alone (so every
    weight of one K reduces alike), each a whole number of K steps of 128."""
    split = 1
    while split < _MAX_RULE_SLICES and k >= _LONG_K * split and k % (2 * split * 128) == 0:
        split *= 2
    return split


def rule_plan(n: int, k: int, capability: tuple[int, int] = (9, 0)) -> MatmulPlan:
    """A plan for any (N, K) on a GPU of `capability`: `rule_split(k)` slices of K, each slice in a program of its
    own, and tiles by M whose columns fill the multiprocessors. At decode sizes (M <= 32) x's rows are the tensor
    cores' columns: 128 weight rows a tile where that makes enough programs, else 64 with six stages of 128 K in
    flight where that makes half as many, else 64 rows of x against the widest narrow column tile that fills the
    chip; then 64 rows of x against the widest column tile that still fills it; from M = 129 on 128 x 128 tiles over
    8 warps where they fill it, through the copy engine at prefill sizes. Where no tile was proven against another
    on the GPU, one plain tile for every M: invariant by construction, slower at decode sizes.

    Measured on an H200 against the tuned plans of Qwen3-8B and Llama-3.1-8B (bench/results/h200.md): 64-row
    swapped tiles are what the tuner chose at decode sizes for weights of 4096 to 6144 rows; and slices of K added
    inside one `tl.dot` program ran 1.4 to 15 times slower than cuBLAS at M = 256..512, where slices in programs
    of their own ran within 1.35 of it at M <= 128."""
    if k % 64:
        # A ragged K, or steps of 16: one plain tile and one slice, whose zero-padded last step only it takes.
        block_k = 64 if k % INSTRUCTION_K else INSTRUCTION_K
        return MatmulPlan(1, ((LARGE_M, _tile(64, 64, block_k, 4, 4)),))
    split = rule_split(k)
    if capability not in PROVEN_CAPABILITIES:
        return unproven_plan(n, k)
    decode_k = 128 if (k // split) % 128 == 0 else 64
    apart = split > 1
    slices = split if apart else 1
    chosen: list[tuple[int, MatmulTile]] = []
    for max_m in (16, 32):
        if -(-n // 128) * slices >= _TARGET_PROGRAMS:
            tile = _tile(max_m, 128, decode_k, 4, 4, split_programs=apart, swap=True)
        elif -(-n // 64) * slices >= _TARGET_PROGRAMS // 2:
            tile = _tile(max_m, 64, decode_k, 4, 6, split_programs=apart, swap=True)
        else:
            tile = _tile(64, _columns(n, 1, slices), decode_k, 4, 6, split_programs=apart)
        chosen.append((max_m, tile))
    for max_m in _RULE_BANDS:
        if max_m > 128 and -(-max_m // 128) * -(-n // 128) >= _TARGET_PROGRAMS:
            tile = _tile(128, 128, 64, 8, 4, split_programs=apart)
        else:
            tile = _tile(64, _columns(n, -(-max_m // 64), slices), 64, 4, 6, split_programs=apart)
        chosen.append((max_m, tile))
    chosen.append((LARGE_M, _tile(128, 128, 64, 8, 4, split_programs=apart, tma=True)))
    merged: list[tuple[int, MatmulTile]] = []
    for max_m, tile in chosen:
        if merged and merged[-1][1] == tile:
            merged[-1] = (max_m, tile)
        else:
            merged.append((max_m, tile))
    return MatmulPlan(split, tuple(merged))


def unproven_plan(n: int, k: int) -> MatmulPlan:
    """The rule's plan where no tile was proven against another on the GPU: one plain tile for every M."""
    if k % 64:
        return rule_plan(n, k)  # one plain tile already
    return MatmulPlan(rule_split(k), ((LARGE_M, _tile(128, 128, 64, 8, 2)),))


def _columns(n: int, row_tiles: int, slices: int) -> int:
    """The widest column tile, from 128 of the weight's rows down to 16, that gives `_TARGET_PROGRAMS` programs."""
    for bn in (128, 64, 32):
        if row_tiles * -(-n // bn) * slices >= _TARGET_PROGRAMS:
            return bn
    return 16
