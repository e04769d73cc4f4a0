"""How a Gluon matmul tile is launched: its kernel (matmul_gluon.py, matmul_gluon_swapped.py), tensor descriptors,
compile-time constants and grid, built in one place (`gluon_launch`) for `launch_gluon` and for the compile test."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import matmul_gluon, matmul_gluon_swapped
from .dependent_launch import launch_options
from .matmul_plans import SWAPPED_PARTITION_ROWS, MatmulTile


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
    if tile.swap:
        # With no tail, x's and out's main blocks stand in for the tail's, which the kernel then never uses. A
        # partitioned tile's partitions each copy, multiply and store their own 64 weight rows.
        tail = tile.tail or tile.block_m
        rows = SWAPPED_PARTITION_ROWS if tile.partitions else tile.block_n
        descriptors = (
            ("w", (rows, tile.block_k)),
            ("x", (tile.block_m, tile.block_k)),
            ("x", (tail, tile.block_k)),
            ("out", (tile.block_m, rows)),
            ("out", (tail, rows)),
        )
        constants["TAIL"] = tile.tail
        if not tile.partitions:
            return GluonLaunch(matmul_gluon_swapped._swapped_kernel, descriptors, constants)
        del constants["PROGRAMS_K"]
        return GluonLaunch(
            matmul_gluon_swapped._swapped_specialized_kernel,
            descriptors,
            {**constants, "PARTS": tile.partitions},
        )
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
        return GluonLaunch(
            matmul_gluon._specialized_kernel, descriptors, constants, limit if limit < 255 else None
        )
    return GluonLaunch(matmul_gluon._pipelined_kernel, descriptors, constants)


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
    dependent: bool = True,
) -> None:
    """out = x @ w.T by the Gluon kernel `tile.gluon`, tiles in bands of `group_m` row tiles, a persistent launch on
        at most `multiprocessors` programs. A tile's `split` slices of K run in one program, or with
        `tile.split_programs` each in its own, which leaves its fp32 partial in `partials` [split, M, N] and counts its
        arrival in `arrivals` (a zeroed counter per tile, which the tile's last program zeroes again). The operands must
        be on a Hopper GPU, with non-empty rows the tensor-memory engine can address (matmul.py sees to both). Launched as
    programmatic dependents where the device supports it, unless not `dependent`."""
    (m, k), n = x.shape, w.shape[0]
    options = launch_options(x.device, dependent)
    launch = gluon_launch(tile, split, n, k, group_m, options["PDL"])
    tiles = tile.tiles(m, n)
    walks = tile.gluon == "persistent" or tile.partitions > 0
    programs = min(tiles, multiprocessors) if walks else tiles
    operands = {"x": x, "w": w, "out": out}
    descriptors = [
        matmul_gluon._descriptor(operands[name], list(block)) for name, block in launch.descriptors
    ]
    registers = {"maxnreg": launch.maxnreg} if launch.maxnreg else {}
    launch.kernel[(programs, split if tile.split_programs else 1)](
        *descriptors,
        partials,
        arrivals,
        m,
        n,
        **launch.constants,
        launch_pdl=options["launch_pdl"],
        **registers,
    )
