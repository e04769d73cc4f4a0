"""Specification of the matmul tiles written in Gluon (pinned_backend/kernels/triton/matmul_gluon.py): every tile
kind gives every row the bits of the `tl.dot` tiles, eager, replayed from a graph, right after the kernel writing its
operand, and in fp16. Needs a Hopper GPU; skipped cleanly without one.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.kernels.triton.matmul import matmul
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile
from tests.test_kernels_triton import gpu, needs_cuda


def _assert_waits_for_the_kernel_writing_its_operand(
    triton_ops,
    x: torch.Tensor,
    w: torch.Tensor,
    plan: MatmulPlan,
    tile: MatmulTile,
    reference: MatmulTile,
    launches: Launches,
) -> None:  # type: ignore[no-untyped-def]
    """Launched right after the kernel that writes its operand, in a graph where both launch as programmatic
    dependents, `tile` must wait for that kernel's writes: a stale operand, zeroed before the replay, would show."""
    k = x.shape[1]
    w_in = (torch.randn(k, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    writer = triton_ops.TritonKernels(launches=launches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        operand = writer.matmul(x, w_in)
        chained = matmul(operand, w, plan, tile, launches=launches)
    operand.zero_()
    chained.zero_()
    graph.replay()
    expected = matmul(writer.matmul(x, w_in), w, plan, reference, launches=launches)
    assert torch.equal(chained, expected), (
        f"{tile} read its operand before the kernel writing it had finished"
    )


# The Gluon tiles the plans serve, and one of each K step.
_GLUON_BLOCKS = [
    (128, 128, 64, 8, 5),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 6),
    (64, 128, 128, 4, 4),
    (64, 64, 64, 4, 8),
]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k", "split"), [(2048, 6144, 2), (12288, 2048, 1), (2048, 2048, 1)])
def test_a_gluon_tile_gives_the_bits_of_its_tl_dot_twin(
    triton_ops, unwritten_elements_show: None, n: int, k: int, split: int
) -> None:  # type: ignore[no-untyped-def]
    launches = Launches()
    matmul_with_plan = functools.partial(matmul, launches=launches)
    x = torch.randn(2200, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    for blocks in _GLUON_BLOCKS:
        twin = MatmulTile(*blocks, tma=True)
        plan = MatmulPlan(split, ((1 << 62, twin),))
        # With slices of K, also each slice in a program of its own (not persistent programs, which walk tiles).
        kernels = [("specialized", False), ("pipelined", False), ("persistent", False)]
        kernels += [("specialized", True), ("pipelined", True)] if split > 1 else []
        for kernel, split_programs in kernels:
            gluon = MatmulTile(*blocks, split_programs=split_programs, gluon=kernel)
            try:
                MatmulPlan(split, ((1 << 62, gluon),)).check(k)
            except ValueError:
                continue  # its accumulators would not fit this many slices
            # One row, a part-empty last row tile, more tiles than multiprocessors, and bands of row tiles.
            for m in (1, 64, 130, 264, 336, 512, 700, 2200):
                assert torch.equal(
                    matmul_with_plan(x[:m], w, plan, gluon), matmul_with_plan(x[:m], w, plan, twin)
                ), f"{gluon} at M = {m} gives other bits than {twin}"
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = matmul_with_plan(x[:336], w, plan, gluon)
            replayed.zero_()
            graph.replay()
            assert torch.equal(replayed, matmul_with_plan(x[:336], w, plan, twin)), (
                f"{gluon} replayed from a graph"
            )
    gluon = MatmulTile(128, 128, 64, 8, 5, gluon="persistent")
    plan = MatmulPlan(split, ((1 << 62, gluon),))
    twin = MatmulTile(128, 128, 64, 8, 5, tma=True)
    # fp16 operands too.
    x16, w16 = x[:336].half(), w.half()
    assert torch.equal(matmul_with_plan(x16, w16, plan, gluon), matmul_with_plan(x16, w16, plan, twin))
    _assert_waits_for_the_kernel_writing_its_operand(triton_ops, x[:264], w, plan, gluon, twin, launches)
    # Rows the copy engine cannot address (a stride of K + 1 elements) go to the twin, with the same bits.
    strided = torch.empty(300, k + 1, device="cuda", dtype=torch.bfloat16)[:, :k]
    strided.copy_(x[:300])
    assert torch.equal(matmul_with_plan(strided, w, plan, gluon), matmul_with_plan(x[:300], w, plan, gluon))
    torch.cuda.synchronize()
    counters = launches.arrivals.get(x.device)
    assert counters is None or int(counters.count_nonzero()) == 0, "a tile's slice counter was left set"


# Swapped Gluon tiles: x's rows in a main block and a tail (80, 96 and 160 rows a tile) and without one.
_GLUON_SWAPPED_BLOCKS = [
    (64, 64, 64, 4, 6, 32),
    (64, 128, 64, 8, 4, 32),
    (128, 128, 64, 8, 4, 16),
    (128, 64, 64, 4, 4, 32),
    (32, 64, 128, 4, 6, 0),
]
# Swapped specialized tiles: one to four partitions of 64 weight rows (the 192-row tile's three among them), with
# and without a tail.
_GLUON_PARTITIONED_BLOCKS = [
    (64, 64, 64, 4, 8, 32),
    (128, 128, 64, 4, 4, 0),
    (128, 192, 64, 4, 4, 16),
    (64, 192, 64, 4, 5, 32),
    (64, 256, 64, 4, 3, 32),
]


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k", "split"), [(2048, 6144, 2), (12288, 2048, 1)])
def test_a_swapped_gluon_tile_gives_every_row_the_bits_of_the_unswapped_tiles(
    triton_ops, unwritten_elements_show: None, n: int, k: int, split: int
) -> None:  # type: ignore[no-untyped-def]
    launches = Launches()
    matmul_with_plan = functools.partial(matmul, launches=launches)
    x = torch.randn(2200, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    plain = MatmulTile(128, 128, 64, 8, 5, tma=True)
    plan = MatmulPlan(split, ((1 << 62, plain),))
    expected = matmul_with_plan(x, w, plan, plain)
    # With slices of K, also each slice in a program of its own (not persistent programs, which walk tiles).
    kernels = [("pipelined", False), ("persistent", False)] + ([("pipelined", True)] if split > 1 else [])
    cases = [(blocks, kernels) for blocks in _GLUON_SWAPPED_BLOCKS]
    cases += [(blocks, [("specialized", False)]) for blocks in _GLUON_PARTITIONED_BLOCKS]
    for (*blocks, tail), kernels_of_blocks in cases:
        for kernel, split_programs in kernels_of_blocks:
            gluon = MatmulTile(*blocks, split_programs=split_programs, swap=True, tail=tail, gluon=kernel)
            try:
                MatmulPlan(split, ((1 << 62, gluon),)).check(k)
            except ValueError:
                continue  # its accumulators would not fit this many slices
            # Fewer rows than the tail's start, a tile of main block and tail exactly, a part-filled last tile
            # moved back to end at M, more tiles than multiprocessors.
            for m in (1, 16, 80, 96, 130, 264, 336, 512, 2200):
                assert torch.equal(matmul_with_plan(x[:m], w, plan, gluon), expected[:m]), (
                    f"{gluon} at M = {m} gives other bits than {plain}"
                )
            # Rows in another place of the tile give the same bits.
            assert torch.equal(matmul_with_plan(x[7:300], w, plan, gluon), expected[7:300])
    for gluon in (
        MatmulTile(64, 64, 64, 4, 6, swap=True, tail=32, gluon="pipelined"),
        MatmulTile(64, 192, 64, 4, 5, swap=True, tail=32, gluon="specialized"),
    ):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = matmul_with_plan(x[:264], w, plan, gluon)
        replayed.zero_()
        graph.replay()
        assert torch.equal(replayed, expected[:264]), f"{gluon} replayed from a graph"
        _assert_waits_for_the_kernel_writing_its_operand(triton_ops, x[:264], w, plan, gluon, plain, launches)
        # fp16 operands too.
        x16, w16 = x[:264].half(), w.half()
        assert torch.equal(matmul_with_plan(x16, w16, plan, gluon), matmul_with_plan(x16, w16, plan, plain))
        # Rows the copy engine cannot address go to the `tl.dot` twin (of 64 weight rows, for a partitioned tile).
        strided = torch.empty(300, k + 1, device="cuda", dtype=torch.bfloat16)[:, :k]
        strided.copy_(x[:300])
        assert torch.equal(matmul_with_plan(strided, w, plan, gluon), expected[:300]), f"{gluon}'s twin"
    torch.cuda.synchronize()
    counters = launches.arrivals.get(x.device)
    assert counters is None or int(counters.count_nonzero()) == 0, "a tile's slice counter was left set"
