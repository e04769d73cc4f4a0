"""Specification of the matmul tuner's decisions (pinned_backend/kernels/triton/tuner.py): which tile serves which M,
which shapes a set of models has, which candidates a shape gets. Timing and proving need a GPU, and run where
`bench/gpu_run.sh tune` runs."""

from __future__ import annotations

import math

import pytest

from pinned_backend.kernels.triton.matmul_candidates import candidate_tiles
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile, rule_plan, rule_split
from pinned_backend.kernels.triton.tuner import PREFILL_M, TIMED_M, plan_from, shapes_of

NARROW = MatmulTile(16, 64, 128, 4, 6, swap=True)
MIDDLE = MatmulTile(64, 128, 64, 4, 6)
WIDE = MatmulTile(128, 128, 64, 8, 4, tma=True)


def test_each_timed_m_takes_the_fastest_tile_up_to_that_m_and_the_prefill_size_every_larger_m() -> None:
    times = {
        NARROW: {m: m for m in TIMED_M} | {PREFILL_M: math.inf},
        MIDDLE: {m: 40.0 for m in TIMED_M} | {PREFILL_M: 500.0},
        WIDE: {m: 100.0 if m < 512 else 30.0 for m in TIMED_M} | {PREFILL_M: 400.0},
    }
    plan = plan_from(times, 2)
    assert plan.split_k == 2
    assert plan.tiles == ((32, NARROW), (448, MIDDLE), (1 << 62, WIDE))
    for m in TIMED_M:
        assert times[plan.tile_for(m)][m] == min(t[m] for t in times.values())


def test_a_shape_shared_by_several_weights_is_tuned_once_for_all_of_them() -> None:
    shapes = shapes_of(
        [
            ("qwen3-8b", {"qkv": (6144, 4096), "o_proj": (4096, 4096)}),
            ("llama-3.1-8b", {"qkv": (6144, 4096), "down": (4096, 14336)}),
        ]
    )
    assert shapes == {
        (6144, 4096): ["qwen3-8b.qkv", "llama-3.1-8b.qkv"],
        (4096, 4096): ["qwen3-8b.o_proj"],
        (4096, 14336): ["llama-3.1-8b.down"],
    }


@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 12288), (151936, 4096), (5120, 25600)])
@pytest.mark.parametrize("families", ["tuner", "all"])
def test_candidates_start_with_the_rule_s_tiles_and_all_reduce_in_the_rule_s_order(
    n: int, k: int, families: str
) -> None:
    split = rule_split(k)
    tiles = candidate_tiles(n, k, split, families)
    rule_tiles = list(dict.fromkeys(t for _, t in rule_plan(n, k).tiles))
    assert tiles[: len(rule_tiles)] == rule_tiles
    assert len(set(tiles)) == len(tiles)
    for tile in tiles:
        MatmulPlan(split, ((1 << 62, tile),)).check(k)
