"""Checks of the matmul's bookkeeping run under Triton's interpreter, on the CPU: `python -m tests.support.interpreted_kernels`
with TRITON_INTERPRET=1 (tests/test_kernels_interpreted.py starts it so, since Triton reads the variable when a
kernel is defined). Exits non-zero, naming the case, where a way of cutting the work or of loading the operands gives
other bits than one program per tile with plain loads.

The interpreter computes a dot through numpy, not the tensor cores, and gets bf16 wrong, so these checks use fp16
and compare tiles of one shape only: they prove which program takes which chain, K step, slice and carry, not the
GPU's sums, which tests/test_kernels_triton.py proves on a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import sys

import torch

from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.kernels.triton.matmul import matmul
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile

ONE_PROGRAM_PER_TILE = MatmulTile(64, 64, 32, 4, 2)


def main() -> int:
    matmul_module = importlib.import_module("pinned_backend.kernels.triton.matmul")
    gen = torch.Generator().manual_seed(0)
    k = 320
    x = torch.randn(300, k, generator=gen).to(torch.float16)
    w = (torch.randn(160, k, generator=gen) / 18).to(torch.float16)
    failures = []
    launches = Launches()
    ways = {
        "through the copy engine": dataclasses.replace(ONE_PROGRAM_PER_TILE, tma=True),
        "streamed": dataclasses.replace(ONE_PROGRAM_PER_TILE, stream=True),
        "streamed, through the copy engine": dataclasses.replace(ONE_PROGRAM_PER_TILE, stream=True, tma=True),
        "a slice per program": dataclasses.replace(ONE_PROGRAM_PER_TILE, split_programs=True),
        # The interpreter runs no Gluon: a Gluon tile goes to its `tl.dot` twin.
        "a Gluon tile": dataclasses.replace(ONE_PROGRAM_PER_TILE, gluon="persistent"),
        "a Gluon tile, a slice per program": dataclasses.replace(
            ONE_PROGRAM_PER_TILE, split_programs=True, gluon="pipelined"
        ),
    }
    # A swapped tile's dot is the transpose of the unswapped one's, whose sums numpy may order otherwise on some CPUs
    # (its matrix kernels differ by instruction set). These are checked on operands of small multiples of 1/8, whose
    # every sum is exact in fp32 in any order.
    swapped_ways = {
        "a swapped Gluon tile with a tail": MatmulTile(
            32, 64, 32, 4, 2, swap=True, tail=16, gluon="pipelined"
        ),
        "a swapped Gluon tile with a tail, a slice per program": MatmulTile(
            32, 64, 32, 4, 2, split_programs=True, swap=True, tail=16, gluon="pipelined"
        ),
        # Its twin takes one partition's 64 weight rows a tile.
        "a swapped specialized Gluon tile of three partitions": MatmulTile(
            32, 192, 32, 4, 2, swap=True, tail=16, gluon="specialized"
        ),
    }
    exact_x = (torch.randint(-8, 9, x.shape, generator=gen) / 8).to(torch.float16)
    exact_w = (torch.randint(-8, 9, w.shape, generator=gen) / 8).to(torch.float16)
    # Program counts and sizes that cut chains between programs at many places, with one and two slices of K.
    for programs, split, m in itertools.product([4, 7], [1, 2], [1, 257]):
        matmul_module._multiprocessors = lambda device, n=programs: n
        plan = MatmulPlan(split, ((1 << 62, ONE_PROGRAM_PER_TILE),))
        for cases, a, b in ((ways, x, w), (swapped_ways, exact_x, exact_w)):
            expected = matmul(a[:m], b, plan, ONE_PROGRAM_PER_TILE, launches=launches)
            for name, tile in cases.items():
                if not torch.equal(matmul(a[:m], b, plan, tile, launches=launches), expected):
                    failures.append(f"{name}: M = {m}, {split} slices, {programs} programs")
    counters = launches.arrivals[torch.device("cpu")]
    if counters.count_nonzero():
        failures.append("a carry flag or a slice counter was left set")
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
