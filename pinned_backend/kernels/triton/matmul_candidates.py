"""The matmul tiles the tuner (tuner.py) may try: each family of candidate tiles, why it is there, and which of them
fit a weight's shape and reduction order by the plans' own rules.

Two sets: "tuner", a few tiles of each kind that a time-bounded tune can afford (the kinds that won some size in the
sweeps behind the shipped plans), and "all", every family those sweeps tried, for a tune given the time. Knows
nothing of timing or of GPUs.
"""

from __future__ import annotations

from .matmul_plans import LARGE_M, MatmulPlan, MatmulTile, rule_plan

# Shared memory a `tl.dot` tile's stages may take (a Gluon tile is held to the plans' own check instead).
SMEM_BYTES = 220 * 1024

# (block_m, block_n, block_k, warps, stages): narrow tiles with deep pipelines for small M (enough programs and
# weight bytes in flight), wide tiles for large M (arithmetic); all of them wgmma's shapes: tiles that won some M in
# the sweeps, and their neighbours.
SMALL_TILES = [
    (64, 16, 128, 4, 6),
    (64, 32, 128, 4, 6),
    (64, 64, 64, 4, 6),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 6),
    (64, 256, 64, 4, 4),
]
LARGE_TILES = [
    (64, 128, 128, 4, 3),
    (128, 64, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
]
# Wide tiles also tried with operands copied by the tensor-memory engine (TMA): faster from M = 256 or so on.
TMA_TILES = [
    (64, 128, 64, 4, 6),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
    (256, 128, 64, 8, 3),
]
# Swapped tiles (out.T = w @ x.T): 16 to 64 of x's rows against 64 or 128 weight rows, for decode sizes.
SWAP_TILES = [
    (16, 64, 128, 4, 6),
    (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 6),
    (32, 128, 128, 4, 4),
    (64, 128, 64, 4, 6),
]
# Swapped tiles for M = 129..512 whose programs take all of a step's rows, or a large block and a tail block of
# them (128 + 16 for M = 144), so that the weight is read once and few rows idle: (rows, weight rows, K step,
# warps, stages, tail).
WIDE_SWAP_TILES = [
    (128, 64, 64, 4, 4, 0),
    (128, 64, 64, 4, 3, 16),
    (128, 64, 64, 4, 3, 32),
    (128, 64, 64, 4, 3, 64),
    (128, 128, 64, 8, 3, 0),
    (128, 128, 64, 8, 3, 16),
    (128, 128, 64, 8, 3, 32),
    (256, 64, 64, 8, 3, 0),
    (256, 64, 64, 8, 3, 32),
    (256, 64, 64, 8, 3, 64),
    # 256 rows against 128 weight rows: the weight read once, at the most arithmetic per byte loaded that fits.
    (256, 128, 64, 8, 3, 0),
    (256, 128, 64, 8, 3, 16),
    (256, 128, 64, 8, 3, 32),
    # 64 + 16 or 32 rows: M = 257..320 or 257..384 in four blocks, one round of 128 programs over a 2048-wide
    # weight's 64-row tiles, where plain 64-row tiles need five blocks and two rounds.
    (64, 64, 64, 4, 4, 16),
    (64, 64, 64, 4, 4, 32),
    (64, 128, 64, 4, 4, 16),
    (64, 128, 64, 4, 4, 32),
]
# A TMA launch encodes two descriptors on the host (59 to 150 us a call against 36 to 81 for plain loads), but served
# steps replay from CUDA graphs (pinned_backend/step_graphs.py), where no launch costs the host anything, so TMA
# tiles compete at every M on their GPU time alone.
# A slice per program: the tile's last program adds the slices, so it costs no second launch and may serve any M.
SPLIT_PROGRAM_TILES = [
    (64, 16, 128, 4, 6),
    (64, 32, 128, 4, 6),
    (64, 64, 64, 4, 6),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 6),
    (128, 64, 64, 8, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (256, 64, 64, 8, 3),
]
# Swapped tiles with a slice per program: two for decode sizes, the 128-row wide ones with and without a tail,
# and 64 rows and a tail against 128 weight rows (M = 257..320 or ..384 in 4 x 16 tiles of two slices: one round).
SWAP_SPLIT_PROGRAM_TILES = [(16, 64, 128, 4, 6, 0), (32, 128, 64, 4, 6, 0), (128, 64, 64, 4, 3, 0)] + [
    t for t in WIDE_SWAP_TILES if t[:5] in ((128, 64, 64, 4, 3), (64, 128, 64, 4, 4))
]
# Streamed tiles: up to one program per multiprocessor, each an equal run of a row tile's (column tile, K step)
# units, for the sizes where a last round of tiles would leave most multiprocessors idle.
STREAM_TILES = [
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (64, 128, 64, 4, 6),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
]
# Streamed tiles loading through the tensor-memory engine, as the TMA tiles that win at M = 257..512 do.
STREAM_TMA_TILES = [
    (64, 128, 64, 4, 6),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
]
# Tiles for the Gluon kernels (matmul_gluon.py): the tiles and kernels that won some size when each Gluon tile was
# timed alone against the plans, each of the three kernels.
GLUON_TILES = [
    (64, 64, 64, 4, 8),
    (64, 128, 64, 4, 6),
    (64, 128, 128, 4, 4),
    (64, 256, 64, 4, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
]
GLUON_KERNELS = ("specialized", "pipelined", "persistent")
# Gluon tiles with a slice of K per program, for reduction orders of several slices: twice the programs of the
# tile, which at M = 257..512 fill the multiprocessors with tiles wide enough to run near the tensor cores' rate
# (a 128 x 128 Gluon tile of the down projection took 31 us at every M from 128 to 512: 16 to 64 programs, each
# walking all of K). Not persistent: a persistent program walks whole tiles.
GLUON_SPLIT_PROGRAM_TILES = [
    (64, 64, 64, 4, 4),
    (64, 64, 64, 4, 8),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 4, 6),
    (64, 128, 128, 4, 4),
    (128, 128, 64, 8, 4),
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
]
GLUON_SPLIT_PROGRAM_KERNELS = ("specialized", "pipelined")
# Swapped Gluon tiles (`_swapped_kernel`): x's rows as the tensor cores' columns, so that a tile's rows of x fit M as
# a main block and a tail (64 + 32 = 96: M = 264 in three tiles, not five of 64), for M = 129..512; and narrow ones
# for decode sizes. Each keeps about 200 KB of copies in flight: rings of 120 KB fed a multiprocessor 77 GB/s where
# unswapped tiles with 192 KB took 109, as a fixed latency would. (x's rows, weight rows, K step, warps, stages,
# tail).
GLUON_SWAP_TILES = [
    (16, 64, 128, 4, 8, 0),
    (32, 64, 128, 4, 8, 0),
    (32, 128, 128, 4, 5, 0),
    (64, 64, 128, 4, 5, 16),
    (64, 64, 128, 4, 5, 32),
    (64, 128, 64, 4, 7, 16),
    (64, 128, 64, 4, 7, 32),
    (64, 128, 64, 8, 7, 32),
    (128, 64, 128, 4, 4, 16),
    (128, 64, 64, 4, 7, 32),
    (128, 128, 64, 8, 5, 16),
    (128, 128, 64, 8, 5, 32),
    (128, 128, 64, 8, 4, 64),
]
GLUON_SWAP_KERNELS = ("pipelined", "persistent")
# Swapped Gluon tiles with a slice of K per program, for reduction orders of several slices: the down projection at
# M = 257..384 as three tiles of 64 + 32 rows against 128 weight rows, two programs each (96 programs, about 130 MB
# of operand copies, against five 64-row tiles' 190 MB in 80 programs). They fed each multiprocessor about half the
# bytes a second of their whole-K twins and won no size above M = 32.
GLUON_SWAP_SPLIT_PROGRAM_TILES = [
    (32, 64, 128, 4, 8, 0),
    (64, 64, 128, 4, 5, 16),
    (64, 64, 128, 4, 5, 32),
    (64, 128, 64, 4, 7, 16),
    (64, 128, 64, 4, 7, 32),
    (64, 128, 64, 8, 7, 16),
    (64, 128, 64, 8, 7, 32),
    (128, 64, 128, 4, 4, 16),
    (128, 128, 64, 8, 5, 16),
    (128, 128, 64, 8, 5, 32),
]
# Swapped specialized Gluon tiles (`_swapped_specialized_kernel`): a warpgroup of its own for each 64 weight rows, so
# that a tile may have 192 of them, as cuBLAS's 192 x 176 blocks for gate_up at M = 336 do (128 of them: one round
# on 132 multiprocessors, where 128- and 256-row tiles leave a quarter idle or take two). Each with the deepest ring
# that fits. The narrowest, of 64 weight rows or of 32 + 16 of x's rows, give the down projection 96 to 128 tiles at
# M = 129..320, as cuBLAS's 64 x 88 blocks at 264 do. (x's rows, weight rows, K step, warps a partition, stages,
# tail).
GLUON_PARTITIONED_TILES = [
    (32, 64, 64, 4, 15, 16),
    (64, 64, 64, 4, 13, 0),
    (64, 64, 64, 4, 11, 16),
    (64, 64, 64, 4, 10, 32),
    (32, 128, 64, 4, 9, 16),
    (64, 128, 64, 4, 8, 0),
    (64, 128, 64, 4, 7, 16),
    (64, 128, 64, 4, 7, 32),
    (64, 128, 64, 4, 6, 64),
    (128, 128, 64, 4, 6, 0),
    (128, 128, 64, 4, 5, 16),
    (128, 128, 64, 4, 5, 32),
    (128, 128, 64, 4, 4, 64),
    (64, 192, 64, 4, 6, 0),
    (64, 192, 64, 4, 5, 16),
    (64, 192, 64, 4, 5, 32),
    (64, 192, 64, 4, 4, 64),
    (128, 192, 64, 4, 4, 0),
    (128, 192, 64, 4, 4, 16),
    (128, 192, 64, 4, 3, 32),
    (128, 192, 64, 4, 3, 64),
    (64, 256, 64, 4, 4, 32),
    (128, 256, 64, 4, 3, 0),
]


def partitioned_tiles() -> list[MatmulTile]:
    return [MatmulTile(*t[:5], swap=True, tail=t[5], gluon="specialized") for t in GLUON_PARTITIONED_TILES]


# The "tuner" set: the kinds of tile that won some M in the sweeps behind the shipped plans, most often winning first,
# so that a tune cut short by its time bound has tried those. Decode sizes: swapped and narrow plain tiles with deep
# rings; M = 65..128: Gluon tiles of 64 and 128 rows; M = 129..512: swapped specialized Gluon tiles with one
# warpgroup per 64 weight rows (192 of them where N makes one round of 128 tiles), with tails, and wide pipelined
# and persistent ones; prefill sizes: 128 x 256 persistent and a TMA 128 x 128.
TUNER_TILES = [
    MatmulTile(16, 64, 128, 4, 6, swap=True),
    MatmulTile(128, 192, 64, 4, 4, swap=True, gluon="specialized"),
    MatmulTile(64, 128, 128, 4, 4, gluon="persistent"),
    MatmulTile(128, 256, 64, 8, 3, gluon="persistent"),
    MatmulTile(32, 64, 128, 4, 6, swap=True),
    MatmulTile(128, 128, 64, 4, 5, swap=True, tail=32, gluon="specialized"),
    MatmulTile(64, 64, 64, 4, 8, gluon="specialized"),
    MatmulTile(64, 128, 64, 4, 7, swap=True, tail=32, gluon="specialized"),
    MatmulTile(64, 128, 128, 4, 4, gluon="pipelined"),
    MatmulTile(32, 128, 128, 4, 4, swap=True),
    MatmulTile(128, 128, 64, 4, 6, swap=True, gluon="specialized"),
    MatmulTile(64, 192, 64, 4, 5, swap=True, tail=32, gluon="specialized"),
    MatmulTile(64, 64, 64, 4, 6),
    MatmulTile(128, 128, 64, 8, 5, gluon="persistent"),
    MatmulTile(128, 128, 64, 8, 5, tma=True),
    MatmulTile(16, 128, 128, 4, 4, swap=True),
    MatmulTile(64, 64, 64, 4, 10, swap=True, tail=32, gluon="specialized"),
    MatmulTile(64, 128, 64, 4, 6),
    MatmulTile(64, 64, 128, 4, 4),
    MatmulTile(128, 256, 64, 8, 3, gluon="specialized"),
]
# With slices of K, the decode tiles that run a slice per program, multiplying programs where tiles are few.
TUNER_SPLIT_TILES = [
    MatmulTile(16, 64, 128, 4, 6, split_programs=True, swap=True),
    MatmulTile(32, 64, 128, 4, 6, split_programs=True, swap=True),
    MatmulTile(64, 32, 128, 4, 6, split_programs=True),
    MatmulTile(64, 64, 64, 4, 6, split_programs=True),
    MatmulTile(64, 64, 64, 4, 8, split_programs=True, gluon="specialized"),
]


def candidate_tiles(n: int, k: int, split: int, families: str = "tuner") -> list[MatmulTile]:
    """The tiles a tune tries for a weight [N, K] in `split` slices, the rule's own first: the "tuner" set, or every
    family above ("all")."""
    if families not in ("tuner", "all"):
        raise ValueError(f"candidate families {families!r}: choose tuner or all")
    tiles = [tile for _, tile in rule_plan(n, k).tiles]
    if families == "tuner":
        tiles += (TUNER_SPLIT_TILES if split > 1 else []) + TUNER_TILES
    else:
        tiles += _every_family(split)
    return usable(list(dict.fromkeys(tiles)), n, k, split)


def _every_family(split: int) -> list[MatmulTile]:
    tiles = [MatmulTile(*t) for t in SMALL_TILES + LARGE_TILES]
    tiles += [MatmulTile(*t, tma=True) for t in TMA_TILES] + [MatmulTile(*t, swap=True) for t in SWAP_TILES]
    tiles += [MatmulTile(*t[:5], swap=True, tail=t[5]) for t in WIDE_SWAP_TILES]
    tiles += [MatmulTile(*t, stream=True) for t in STREAM_TILES]
    tiles += [MatmulTile(*t, stream=True, tma=True) for t in STREAM_TMA_TILES]
    tiles += [MatmulTile(*t, gluon=kernel) for t in GLUON_TILES for kernel in GLUON_KERNELS]
    tiles += [
        MatmulTile(*t[:5], swap=True, tail=t[5], gluon=kernel)
        for t in GLUON_SWAP_TILES
        for kernel in GLUON_SWAP_KERNELS
    ]
    if split > 1:
        tiles += [MatmulTile(*t, split_programs=True) for t in SPLIT_PROGRAM_TILES]
        tiles += [
            MatmulTile(*t[:5], split_programs=True, swap=True, tail=t[5]) for t in SWAP_SPLIT_PROGRAM_TILES
        ]
        tiles += [
            MatmulTile(*t, split_programs=True, gluon=kernel)
            for t in GLUON_SPLIT_PROGRAM_TILES
            for kernel in GLUON_SPLIT_PROGRAM_KERNELS
        ]
        tiles += [
            MatmulTile(*t[:5], split_programs=True, swap=True, tail=t[5], gluon="pipelined")
            for t in GLUON_SWAP_SPLIT_PROGRAM_TILES
        ]
    return tiles + partitioned_tiles()


def usable(tiles: list[MatmulTile], n: int, k: int, split: int) -> list[MatmulTile]:
    slice_k = k // split
    return [t for t in tiles if slice_k % t.block_k == 0 and 8 <= n / t.block_n <= 2400 and fits(t, k, split)]


def fits(tile: MatmulTile, k: int, split: int) -> bool:
    # A Gluon tile by the plans' own rules: shared memory for its stages and output tile, registers for its
    # accumulators, enough K steps for its ring.
    if tile.gluon:
        try:
            MatmulPlan(split, ((LARGE_M, tile),)).check(k)
        except ValueError:
            return False
        return True
    return (tile.block_m + tile.tail + tile.block_n) * tile.block_k * 2 * tile.num_stages <= SMEM_BYTES
