"""Specification of the Triton `batch_invariant` kernels: right to bf16 accuracy, and bit-identical per row whatever
the batch around the row. Needs CUDA and Triton; skipped cleanly without them. The launch-configuration rules are
plain Python and are checked everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any

import pytest
import torch

from pinned_backend.kernels.triton import plan_files
from pinned_backend.kernels.triton.launches import Launches
from pinned_backend.kernels.triton.matmul import matmul as matmul_with_plan
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile, rule_plan, rule_split
from pinned_backend.kernels.triton.plan_files import MatmulPlans, PlanFile, Proven

QWEN3_1_7B_WEIGHTS = [(4096, 2048), (12288, 2048), (2048, 2048), (2048, 6144), (151936, 2048)]
# The plans shipped for Qwen3-1.7B's weights, whatever GPU and Triton run the tests: those tests prove them here.
QWEN3_1_7B_PLANS = MatmulPlans(
    plan_files.load(plan_files.SHIPPED / "nvidia-h200_triton-3.7.1_qwen3-1.7b.json")
)
HOPPER = Proven("NVIDIA H200", (9, 0), "3.7.1")


def matmul_plan(n: int, k: int, capability: tuple[int, int]) -> MatmulPlan:
    """The plan Qwen3-1.7B's shipped plans give a weight of shape (N, K) on a GPU of `capability`."""
    return QWEN3_1_7B_PLANS.plan(n, k, capability)


def plan_file(
    plans: dict[tuple[int, int], MatmulPlan], proven: Proven = HOPPER, name: str = "t.json"
) -> PlanFile:
    return plan_files.parse(plan_files.dump(proven, ["test"], plans, "for a test"), name)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(
    ("n", "k"), [*QWEN3_1_7B_WEIGHTS, (3072, 2048), (2048, 8192), (128256, 2048), (96, 200)]
)
@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_matmul_plan_depends_on_the_weight_shape_and_the_gpu_only(
    n: int, k: int, capability: tuple[int, int]
) -> None:
    plan = matmul_plan(n, k, capability)
    assert isinstance(plan, MatmulPlan)
    plan.check(k)  # every tile reduces K in the plan's one order
    bounds = [max_m for max_m, _ in plan.tiles]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)
    assert plan.tile_for(1) == plan.tiles[0][1] and plan.tile_for(10**9) == plan.tiles[-1][1]


def test_a_gpu_no_sweep_has_proven_gets_a_plain_tile_even_where_the_plan_has_one_gluon_or_streamed_tile() -> (
    None
):
    for n, tile in (
        (1056, MatmulTile(128, 128, 64, 8, 4, gluon="persistent")),
        (1088, MatmulTile(128, 128, 64, 8, 4, stream=True)),
    ):
        plans = MatmulPlans(plan_file({(n, 1024): MatmulPlan(1, ((1 << 62, tile),))}))
        assert plans.plan(n, 1024, (9, 0)).tiles[0][1] == tile
        unproven = plans.plan(n, 1024, (8, 0)).tiles[0][1]
        assert not (unproven.gluon or unproven.stream or unproven.tma or unproven.swap)


@pytest.mark.parametrize(("n", "k"), [*QWEN3_1_7B_WEIGHTS, (3072, 2048)])
def test_a_gpu_whose_tiles_no_sweep_has_proven_gets_one_plain_tile_for_every_m(n: int, k: int) -> None:
    proven, unproven = matmul_plan(n, k, (9, 0)), matmul_plan(n, k, (8, 0))
    assert len(proven.tiles) > 1
    assert len(unproven.tiles) == 1 and unproven.split_k == proven.split_k
    tile = unproven.tiles[0][1]
    assert not (tile.tma or tile.swap or tile.split_programs)
    unproven.check(k)


def test_a_spliced_plan_takes_the_inner_plan_s_tiles_within_its_range_and_its_own_elsewhere() -> None:
    a, b, c = (
        MatmulTile(64, 64, 64, 4, 4),
        MatmulTile(128, 128, 64, 8, 3),
        MatmulTile(64, 128, 64, 4, 4, swap=True),
    )
    outer = MatmulPlan(1, ((64, a), (1 << 62, b)))
    inner = MatmulPlan(1, ((200, c), (1 << 62, a)))
    spliced = outer.spliced(inner, 129, 512)
    assert spliced.tiles == ((64, a), (128, b), (200, c), (512, a), (1 << 62, b))
    for m in range(1, 1100):
        assert spliced.tile_for(m) == (inner if 129 <= m <= 512 else outer).tile_for(m)
    # From M = 1 no range ends at 0, and neighbouring ranges of one tile merge.
    assert outer.spliced(inner, 1, 100).tiles == ((100, c), (1 << 62, b))
    with pytest.raises(ValueError, match="reduces K in 2 slices, this plan in 1"):
        outer.spliced(MatmulPlan(2, ((1 << 62, a),)), 1, 8)


def test_rule_plan_gives_small_m_enough_programs_and_large_m_wide_tiles() -> None:
    narrow = rule_plan(2048, 2048)
    assert -(-2048 // narrow.tile_for(1).block_n) >= 128
    assert narrow.tile_for(4096).block_m == 128
    assert rule_plan(151936, 2048).tile_for(1).block_n == 128
    assert all(plan.split_k == 1 for plan in (narrow, rule_plan(151936, 2048)))


@pytest.mark.parametrize(
    ("k", "split"),
    [(2048, 1), (4096, 1), (6144, 1), (8192, 2), (12288, 2), (14336, 2), (25600, 4), (8200, 1)],
)
def test_the_rule_cuts_long_reductions_into_slices_by_k_alone(k: int, split: int) -> None:
    assert rule_split(k) == split
    for n in (2048, 4096, 5120, 151936):
        plan = rule_plan(n, k)
        assert plan.split_k == split
        plan.check(k)


@pytest.mark.parametrize(("n", "k"), [(4096, 12288), (4096, 14336), (5120, 25600), (2048, 8192)])
def test_at_decode_sizes_the_rule_s_tiles_and_slices_fill_the_multiprocessors(n: int, k: int) -> None:
    plan = rule_plan(n, k)
    # Swapped tiles of 64 weight rows keep six stages of weight bytes in flight: half as many programs fill the chip.
    for m, programs in ((1, 64), (16, 64), (32, 64), (64, 128)):
        tile = plan.tile_for(m)
        slices = plan.split_k if tile.split_programs else 1
        assert tile.tiles(m, n) * slices >= programs, f"{tile} at M = {m}"
    assert all(tile.split_programs for _, tile in plan.tiles), "slices of K run in programs of their own"


def test_a_plan_file_gives_its_plans_on_the_gpu_it_names_and_the_rule_elsewhere() -> None:
    tile = MatmulTile(64, 128, 64, 4, 6)
    plans = MatmulPlans(plan_file({(4096, 4096): MatmulPlan(1, ((1 << 62, tile),))}))
    assert plans.plan(4096, 4096, (9, 0)).tiles == ((1 << 62, tile),)
    assert plans.plan(4096, 2048, (9, 0)) == rule_plan(4096, 2048)
    assert plans.plan(4096, 4096, (10, 0)) == rule_plan(4096, 4096, (10, 0))


def test_a_plan_file_reads_back_what_was_written_and_names_its_digest() -> None:
    written = {shape: QWEN3_1_7B_PLANS.plan(*shape, (9, 0)) for shape in QWEN3_1_7B_WEIGHTS}
    text = plan_files.dump(HOPPER, ["Qwen3-1.7B"], written, "for a test")
    read = plan_files.parse(text, "p.json")
    assert read.plans == written and read.proven == HOPPER and read.models == ("Qwen3-1.7B",)
    assert read.described() == {
        "name": "p.json",
        "sha256": __import__("hashlib").sha256(text.encode()).hexdigest(),
    }


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (
            lambda t: t.replace('"format": "stackpin-matmul-plans/1"', '"format": "other/1"'),
            "not a plan file",
        ),
        (lambda t: t.replace('"num_warps": 4', '"num_warps": 2', 1), "4 or 8 warps"),
        (lambda t: t.replace('"up_to_m": null', '"up_to_m": 9999'), "the last every larger M"),
        (lambda t: t.replace('"split_k": 1', '"split_k": 3', 1), "N = 4096, K = 2048: "),
        (
            lambda t: t.replace('"swap": true', '"swap": true, "spin": true', 1),
            "unexpected keyword argument 'spin'",
        ),
        (lambda t: t.replace('"block_m": 128', '"block_m": "128"', 1), "sizes are integers"),
    ],
)
def test_a_malformed_plan_file_is_refused_with_what_is_wrong(edit: Any, why: str) -> None:
    plans = {(4096, 2048): QWEN3_1_7B_PLANS.plan(4096, 2048, (9, 0))}
    text = plan_files.dump(HOPPER, ["m"], plans, "for a test")
    with pytest.raises(plan_files.PlanFileError, match=why):
        plan_files.parse(edit(text), "bad.json")


def test_plans_proven_under_another_triton_or_gpu_are_not_used(tmp_path: Any) -> None:
    plans = {(4096, 2048): QWEN3_1_7B_PLANS.plan(4096, 2048, (9, 0))}
    path = tmp_path / "h200-3.7.1.json"
    path.write_text(plan_files.dump(HOPPER, ["m"], plans, "for a test"))
    assert plan_files.plan_file_for(HOPPER, {(4096, 2048)}, path).plans == plans
    for other in (Proven("NVIDIA H200", (9, 0), "3.6.0"), Proven("NVIDIA H100 80GB HBM3", (9, 0), "3.7.1")):
        with pytest.raises(plan_files.PlanFileError, match="proven on NVIDIA H200"):
            plan_files.plan_file_for(other, {(4096, 2048)}, path)
        assert plan_files.choose([plan_files.load(path)], other, {(4096, 2048)}) is None
    assert plan_files.plan_file_for(HOPPER, {(4096, 2048)}, "none") is None


def test_a_model_takes_the_matching_plan_file_that_holds_the_most_of_its_shapes() -> None:
    plan = QWEN3_1_7B_PLANS.plan(4096, 2048, (9, 0))
    one = plan_file({(4096, 2048): plan}, name="a.json")
    two = plan_file(
        {(4096, 2048): plan, (2048, 2048): QWEN3_1_7B_PLANS.plan(2048, 2048, (9, 0))}, name="b.json"
    )
    elsewhere = plan_file({(4096, 2048): plan}, Proven("NVIDIA H100", (9, 0), "3.7.1"), "c.json")
    shapes = {(4096, 2048), (2048, 2048), (12288, 2048)}
    assert plan_files.choose([one, two, elsewhere], HOPPER, shapes) is two
    assert plan_files.choose([two, one], HOPPER, {(4096, 2048)}) is one  # as many: the first by name
    assert plan_files.choose([one, two], HOPPER, {(5, 5)}) is None


def test_every_shipped_plan_file_loads_and_names_the_gpu_and_triton_it_was_proven_under() -> None:
    shipped = plan_files.shipped()
    assert shipped, "the package ships plan files"
    for found in shipped:
        assert found.plans and found.models
        assert found.proven.triton.count(".") == 2 and found.proven.capability == (9, 0)
        for (_n, k), plan in found.plans.items():
            plan.check(k)


@pytest.mark.parametrize(
    ("plan", "k", "why"),
    [
        (MatmulPlan(1, ((1 << 62, MatmulTile(32, 64, 64, 4, 4)),)), 2048, "64, 128 or 256 rows"),
        (MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 2, 4)),)), 2048, "4 or 8 warps"),
        (MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 24, 4, 4)),)), 2048, "multiple of 16"),
        (MatmulPlan(1, ((1 << 62, MatmulTile(8, 64, 64, 4, 4, swap=True)),)), 2048, "16 or more of x's rows"),
        (MatmulPlan(1, ((1 << 62, MatmulTile(16, 32, 64, 4, 4, swap=True)),)), 2048, "64, 128 or 256 rows"),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, tail=16)),)),
            2048,
            "a tail is for swapped tiles",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(128, 64, 64, 4, 4, swap=True, tail=24)),)),
            2048,
            "a power of two of 16 rows or more",
        ),
        (MatmulPlan(2, ((1 << 62, MatmulTile(64, 64, 64, 4, 4)),)), 2000, "every K step must divide"),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, stream=True)),)),
            2000,
            "every K step must divide",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, swap=True, stream=True)),)),
            2048,
            "a streamed tile is not swapped",
        ),
        (
            MatmulPlan(1, ((8, MatmulTile(64, 16, 64, 4, 4)), (1 << 62, MatmulTile(128, 128, 64, 8, 3)))),
            2000,
            "every K step must divide",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, gluon="fast")),)),
            2048,
            "gluon must be one of",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, stream=True, gluon="pipelined")),)),
            2048,
            "a Gluon tile is not streamed",
        ),
        *[
            (
                MatmulPlan(1, ((1 << 62, tile),)),
                2048,
                "a warpgroup of 4 warps for each 64, and every slice of K in one program",
            )
            for tile in (
                MatmulTile(64, 128, 64, 8, 4, swap=True, gluon="specialized"),
                MatmulTile(64, 96, 64, 4, 4, swap=True, gluon="specialized"),
                MatmulTile(64, 320, 64, 4, 2, swap=True, gluon="specialized"),
                MatmulTile(64, 128, 64, 4, 4, split_programs=True, swap=True, gluon="specialized"),
            )
        ],
        (
            MatmulPlan(
                2, ((1 << 62, MatmulTile(128, 192, 64, 4, 2, swap=True, tail=64, gluon="specialized")),)
            ),
            6144,
            "take 192 registers a thread, over 96",
        ),
        (
            MatmulPlan(
                2,
                (
                    (
                        1 << 62,
                        MatmulTile(64, 64, 64, 4, 4, split_programs=True, swap=True, gluon="persistent"),
                    ),
                ),
            ),
            6144,
            "walks whole tiles",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 8, 4, swap=True, tail=16, gluon="pipelined")),)),
            2048,
            "wgmma steps 8 columns wide",
        ),
        (
            MatmulPlan(
                2, ((1 << 62, MatmulTile(128, 128, 64, 8, 4, swap=True, tail=32, gluon="pipelined")),)
            ),
            6144,
            "take 160 registers a thread",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(128, 256, 64, 8, 4, gluon="pipelined")),)),
            2048,
            "more than 232448 bytes of shared memory",
        ),
        (
            MatmulPlan(2, ((1 << 62, MatmulTile(128, 256, 64, 8, 3, gluon="persistent")),)),
            6144,
            "over 128",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4, gluon="specialized")),)),
            2000,
            "every K step must divide",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 1, gluon="pipelined")),)),
            2048,
            "a ring of 2 or more stages",
        ),
        (
            MatmulPlan(2, ((1 << 62, MatmulTile(64, 256, 64, 4, 4, gluon="persistent")),)),
            6144,
            "take 256 registers a thread",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(64, 16, 64, 8, 4, gluon="pipelined")),)),
            2048,
            "wgmma steps 8 columns wide",
        ),
        (
            MatmulPlan(1, ((1 << 62, MatmulTile(128, 128, 64, 8, 5, gluon="persistent")),)),
            128,
            "needs at least 4 K steps",
        ),
        (
            MatmulPlan(
                2, ((1 << 62, MatmulTile(128, 128, 64, 8, 5, split_programs=True, gluon="persistent")),)
            ),
            6144,
            "walks whole tiles",
        ),
    ],
)
def test_a_plan_whose_tiles_could_reduce_in_different_orders_is_refused(
    plan: MatmulPlan, k: int, why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        plan.check(k)


def test_counters_outgrown_by_a_larger_launch_stay_allocated_for_the_graphs_that_captured_them() -> None:
    launches = Launches()
    cpu = torch.device("cpu")
    first = launches.arrival_counters(cpu, 10)
    assert launches.arrival_counters(cpu, first.numel()) is first
    larger = launches.arrival_counters(cpu, first.numel() + 1)
    assert larger.numel() > first.numel() and int(larger.count_nonzero()) == 0
    assert any(kept is first for kept in launches.outgrown)


@pytest.mark.parametrize(("n", "k"), QWEN3_1_7B_WEIGHTS)
def test_a_streamed_launch_cuts_chains_only_among_programs_that_fit_on_the_gpu_at_once(
    n: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A streamed program may wait for the program before it on its row tile to pass on a chain's accumulator, and
    # CUDA does not promise to start programs in order: programs that may wait on each other must all fit on the
    # GPU at once. So the launch is checked here, without running it.
    matmul_module = importlib.import_module("pinned_backend.kernels.triton.matmul")
    launches: list[tuple[Any, ...]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **_: launches.append((grid, args))

    monkeypatch.setattr(matmul_module, "_matmul_stream_kernel", Recorder())
    multiprocessors = 132
    monkeypatch.setattr(matmul_module, "_multiprocessors", lambda device: multiprocessors)
    split = matmul_plan(n, k, (9, 0)).split_k
    w = torch.empty(1, k, dtype=torch.bfloat16).expand(n, k)  # never read: the launch is only recorded
    for tile in (MatmulTile(64, 128, 64, 4, 6, stream=True), MatmulTile(128, 256, 64, 8, 3, stream=True)):
        plan = MatmulPlan(split, ((1 << 62, tile),))
        steps = k // split // tile.block_k
        for m in (1, 64, 129, 272, 336, 512, 4096, 8192, 20000):
            if m * n > 1 << 28:
                continue
            launches.clear()
            matmul_with_plan(torch.empty(1, k, dtype=torch.bfloat16).expand(m, k), w, plan, tile)
            ((programs,), args) = launches[0]
            run, row_tiles = args[12], -(-m // tile.block_m)
            groups, left = divmod(programs, row_tiles)
            assert left == 0, "every group has one program per row tile"
            assert run >= steps, "a run is never shorter than a chain"
            if groups > 1:
                assert programs <= multiprocessors, (
                    f"{tile} at M = {m}: carrying programs outnumber the GPU's"
                )


def test_a_ragged_k_is_allowed_to_a_plan_of_one_tile_and_one_slice() -> None:
    MatmulPlan(1, ((1 << 62, MatmulTile(64, 64, 64, 4, 4)),)).check(2000)


@pytest.mark.parametrize("split", [0, 16, 100])
def test_a_kv_split_the_gpu_attention_cannot_walk_is_refused_when_the_kernels_are_made(split: int) -> None:
    from pinned_backend.kernels.triton import TritonKernels

    with pytest.raises(ValueError, match="positive multiple of 64"):
        TritonKernels(kv_split_size=split)


@gpu
@needs_cuda
def test_default_mode_on_cuda_is_cublas_over_the_same_triton_kernels(triton_ops) -> None:  # type: ignore[no-untyped-def]
    from pinned_backend.kernels import select_kernels

    kernels = select_kernels("default", torch.device("cuda"), kv_split_size=128)
    assert isinstance(kernels, triton_ops.CublasKernels) and kernels.mode == "default"
    assert kernels.kv_split_size == 128
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(kernels.matmul(x, w), torch.nn.functional.linear(x, w))


@gpu
@needs_cuda
@pytest.mark.parametrize("plans", ["shipped", "rule"])
@pytest.mark.parametrize(("n", "k"), QWEN3_1_7B_WEIGHTS)
def test_matmul_matches_float64_and_is_invariant_across_m_row_position_and_tile(
    triton_ops, unwritten_elements_show: None, n: int, k: int, plans: str
) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(2200, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
    kernels = triton_ops.TritonKernels(plans=QWEN3_1_7B_PLANS if plans == "shipped" else MatmulPlans())
    plan = kernels.plans.plan(n, k, torch.cuda.get_device_capability())
    full = kernels.matmul(x[:512], w)
    assert not full.isnan().any(), "the plan left elements unwritten"
    assert _rel_err(full, x[:512].double() @ w.double().T) < 1e-2
    for _, tile in plan.tiles:
        assert torch.equal(matmul_with_plan(x[:512], w, plan, tile), full), (
            f"{tile} gives other bits than the plan"
        )
    edges = {m + d for m, _ in plan.tiles[:-1] for d in (-1, 0, 1)}
    for m in sorted(edges | {1, 2, 3, 7, 16, 63, 64, 65, 127, 200, 333, 511, 512}):
        if 1 <= m <= 512:
            assert torch.equal(kernels.matmul(x[:m], w), full[:m]), (
                f"rows changed when M went from 512 to {m}"
            )
    for j in (1, 5, 77):
        assert torch.equal(kernels.matmul(x[j : j + 512], w)[: 512 - j], full[j:]), f"rows shifted by {j}"
    # Past 16 row tiles the launch walks bands of row tiles (prefill sizes); a row's bits stay its own.
    for m in (1100, 2200):
        out = kernels.matmul(x[:m], w)
        assert torch.equal(out[:512], full), f"rows changed at M = {m}"
        assert not out.isnan().any(), f"elements left unwritten at M = {m}"


_SLICE_PER_PROGRAM_TILES = [
    MatmulTile(64, 128, 64, 4, 4, split_programs=True),
    MatmulTile(16, 64, 128, 4, 4, split_programs=True, swap=True),
    MatmulTile(128, 64, 64, 4, 3, split_programs=True, swap=True, tail=32),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("split", [2, 4])
def test_slices_in_programs_of_their_own_meet_in_slice_order_and_leave_the_counters_at_zero(
    triton_ops, unwritten_elements_show: None, split: int
) -> None:  # type: ignore[no-untyped-def]
    launches = Launches()
    matmul_with = functools.partial(matmul_with_plan, launches=launches)
    x = torch.randn(700, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(1024, 2048, device="cuda") / 45).to(torch.bfloat16)
    in_one_program = MatmulTile(64, 128, 64, 4, 4)
    for m in (1, 33, 160, 333, 700):
        plan = MatmulPlan(split, ((1 << 62, in_one_program),))
        expected = matmul_with(x[:m], w, plan, in_one_program)
        for tile in _SLICE_PER_PROGRAM_TILES:
            out = matmul_with(x[:m], w, plan, tile)
            assert torch.equal(out, expected), f"{tile} at M = {m} gives other bits than one program per tile"
    counters = launches.arrivals[x.device]
    assert int(counters.count_nonzero()) == 0, "a tile's last program left its counter set"


@gpu
@needs_cuda
@pytest.mark.parametrize(("n", "k", "split"), [(2048, 6144, 2), (12288, 2048, 1), (2048, 2048, 1)])
def test_a_streamed_tile_carries_each_chain_across_programs_to_the_bits_of_one_program(
    triton_ops, unwritten_elements_show: None, n: int, k: int, split: int
) -> None:  # type: ignore[no-untyped-def]
    launches = Launches()
    matmul_with = functools.partial(matmul_with_plan, launches=launches)
    x = torch.randn(700, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    for plain in (
        MatmulTile(128, 128, 64, 8, 4),
        MatmulTile(64, 128, 64, 4, 6),
        MatmulTile(128, 128, 64, 8, 5, tma=True),
    ):
        streamed = dataclasses.replace(plain, stream=True)
        plan = MatmulPlan(split, ((1 << 62, plain),))
        # Sizes that leave a last round of tiles part full, and so cut chains between programs.
        for m in (1, 64, 130, 264, 336, 512, 700):
            expected = matmul_with(x[:m], w, plan, plain)
            out = matmul_with(x[:m], w, plan, streamed)
            assert torch.equal(out, expected), (
                f"{streamed} at M = {m} gives other bits than one program a chain"
            )
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = matmul_with(x[:336], w, plan, streamed)
        for _ in range(2):
            replayed.zero_()
            graph.replay()
            assert torch.equal(replayed, matmul_with(x[:336], w, plan, plain))
    counters = launches.arrivals[x.device]
    assert int(counters.count_nonzero()) == 0, "a carry flag or a slice counter was left set"


@gpu
@needs_cuda
def test_a_slice_per_program_captured_in_a_graph_before_any_eager_launch_replays_right() -> None:
    pytest.importorskip("triton")
    launches = Launches()  # as in a fresh process whose first such product is captured
    matmul_with = functools.partial(matmul_with_plan, launches=launches)
    x = torch.randn(200, 2048, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(2048, 2048, device="cuda") / 45).to(torch.bfloat16)
    tile = MatmulTile(64, 128, 64, 4, 4, split_programs=True)
    plan = MatmulPlan(4, ((1 << 62, tile),))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul_with(x, w, plan, tile)
    assert x.device not in launches.arrivals, "counters made during a capture must not serve other launches"
    one_program = MatmulTile(64, 128, 64, 4, 4)
    expected = matmul_with(x, w, MatmulPlan(4, ((1 << 62, one_program),)), one_program)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, expected)
    eager = matmul_with(x, w, plan, tile)  # and afterwards, eager launches get counters of their own
    assert torch.equal(eager, expected) and int(launches.arrivals[x.device].count_nonzero()) == 0


@gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(300, 2048), (300, 16, 128)])
def test_rms_norm_matches_float64_and_is_invariant(triton_ops, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.rand(shape[-1], device="cuda", dtype=torch.bfloat16) + 0.5
    out = triton_ops.rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert _rel_err(out, ref) < 1e-2
    for m in [1, 5, 64, 299]:
        assert torch.equal(triton_ops.rms_norm(x[:m], w, 1e-6), out[:m])
    assert torch.equal(triton_ops.rms_norm(x[100:], w, 1e-6), out[100:])


@gpu
@needs_cuda
def test_log_softmax_matches_float64_and_is_invariant(triton_ops) -> None:  # type: ignore[no-untyped-def]
    x = (torch.randn(40, 151936, device="cuda") * 4).to(torch.bfloat16)
    out = triton_ops.log_softmax(x)
    assert out.dtype == torch.float32
    assert _rel_err(out, torch.log_softmax(x.double(), dim=-1)) < 1e-5
    for m in [1, 3, 39]:
        assert torch.equal(triton_ops.log_softmax(x[:m]), out[:m])
    assert torch.equal(triton_ops.log_softmax(x[17:]), out[17:])


def attention_reference(q, k_seq, v_seq, pos, scale):  # type: ignore[no-untyped-def]
    """float64 causal attention of one query [Hq, D] over keys 0..pos of [L, Hkv, D]."""
    group = q.shape[0] // k_seq.shape[1]
    k = k_seq[: pos + 1].double().repeat_interleave(group, dim=1)
    v = v_seq[: pos + 1].double().repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", w, v)


class _Cache:
    """A paged cache holding the same keys and values for each sequence in freshly shuffled pages."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], page: int, seed: int) -> None:
        n_pages = [-(-k.shape[0] // page) for k in keys]
        total = sum(n_pages) + 3
        hkv, d = keys[0].shape[1:]
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        self.k = torch.full((total, page, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.v = torch.full_like(self.k, float("nan"))
        self.tables = torch.full((len(keys), max(n_pages) + 2), -1, dtype=torch.int32)
        for s, (k, v) in enumerate(zip(keys, values, strict=True)):
            for i in range(n_pages[s]):
                blk = order.pop()
                self.tables[s, i] = blk
                rows = slice(i * page, min((i + 1) * page, k.shape[0]))
                self.k[blk, : rows.stop - rows.start] = k[rows]
                self.v[blk, : rows.stop - rows.start] = v[rows]
        self.tables = self.tables.cuda()


@gpu
@needs_cuda
@pytest.mark.parametrize("split", [128, 256])
def test_attention_matches_float64_and_does_not_depend_on_how_the_step_was_built(
    triton_ops, split: int
) -> None:  # type: ignore[no-untyped-def]
    hq, hkv, d, page, scale = 16, 8, 128, 16, 128**-0.5
    lengths = [700, 37, 300, 1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = [torch.randn(n, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    values = [torch.randn(n, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    queries = [torch.randn(n, hq, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    kernels = triton_ops.TritonKernels(kv_split_size=split)

    def run(cache: _Cache, parts: list[tuple[int, int, int]]) -> torch.Tensor:
        """One step made of (sequence, first position, count) parts, in that order."""
        q = torch.cat([queries[s][p : p + c] for s, p, c in parts])
        seq = torch.cat([torch.full((c,), s, dtype=torch.int32) for s, _, c in parts]).cuda()
        pos = torch.cat([torch.arange(p, p + c, dtype=torch.int32) for _, p, c in parts]).cuda()
        return kernels.attention(q, cache.k, cache.v, cache.tables, seq, pos, scale)

    prefill = run(_Cache(keys, values, page, seed=1), [(0, 0, 700), (1, 0, 37), (2, 0, 300), (3, 0, 1)])
    target = prefill[:700]
    for p in [0, 255, 256, 257, 699]:
        ref = attention_reference(queries[0][p], keys[0], values[0], p, scale)
        assert _rel_err(target[p], ref) < 1e-2, f"position {p} is wrong"

    alone = run(_Cache(keys, values, page, seed=2), [(0, 0, 700)])
    assert torch.equal(alone, target), "attention changed with the other sequences in the step"
    chunked = torch.cat(
        [
            run(_Cache(keys, values, page, seed=3), [(2, 5, 9), (0, lo, hi - lo), (1, 0, 3)])[9 : 9 + hi - lo]
            for lo, hi in [(0, 100), (100, 101), (101, 333), (333, 700)]
        ]
    )
    assert torch.equal(chunked, target), "chunked prefill changed the attention output"
    decode_cache = _Cache(keys, values, page, seed=4)
    for p in [0, 1, 63, 64, 255, 256, 511, 699]:
        step = run(decode_cache, [(1, 36, 1), (0, p, 1), (2, 299, 1)])
        assert torch.equal(step[1], target[p]), f"a decode step at position {p} changed the attention output"


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 100])
def test_default_mode_prefills_through_flash_attention_over_the_paged_cache(
    triton_ops, window: int | None
) -> None:  # type: ignore[no-untyped-def]
    from tests.support import kernel_reference as reference

    hq, hkv, d, page, scale = 16, 8, 128, 16, 128**-0.5
    lengths = [700, 37, 300, 5]
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = [torch.randn(n, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    values = [torch.randn(n, hkv, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    queries = [torch.randn(n, hq, d, device="cuda", generator=gen).to(torch.bfloat16) for n in lengths]
    cache = _Cache(keys, values, page, seed=1)
    default = triton_ops.CublasKernels(kv_split_size=128)
    # A first chunk, a later chunk after a prefix-cache hit, a whole prompt and a sequence decoding beside them.
    parts = [(0, 0, 700), (1, 20, 17), (2, 0, 300), (3, 4, 1)]
    q = torch.cat([queries[s][p : p + c] for s, p, c in parts])
    seq = torch.cat([torch.full((c,), s, dtype=torch.int32) for s, _, c in parts]).cuda()
    pos = torch.cat([torch.arange(p, p + c, dtype=torch.int32) for _, p, c in parts]).cuda()

    def run() -> torch.Tensor:
        return default.attention(q, cache.k, cache.v, cache.tables, seq, pos, scale, window=window)

    out = run()
    ref = reference.attention(
        q.cpu(), cache.k.cpu(), cache.v.cpu(), cache.tables.cpu(), seq.cpu(), pos.cpu(), scale, window=window
    )
    assert not out.isnan().any()
    for t in [0, 255, 699, 700, 716, 717, 1016, 1017]:
        assert _rel_err(out[t].cpu(), ref[t]) < 1e-2, f"query row {t} is wrong"
    # The step runs from device tensors alone, so it is captured as the engine captures its steps.
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.testing.assert_close(captured, out, atol=0, rtol=0)
    # A step whose gather would be many times its queries (two queries beside the others' block tables, as a verify
    # pass beside long contexts is) takes the paged kernel, whose bits are the invariant set's.
    short = default.attention(q[:2], cache.k, cache.v, cache.tables[:1], seq[:2] * 0, pos[698:700], scale)
    invariant = triton_ops.TritonKernels(kv_split_size=128)
    assert torch.equal(
        short,
        invariant.attention(q[:2], cache.k, cache.v, cache.tables[:1], seq[:2] * 0, pos[698:700], scale),
    )
    # Soft-capped scores are a variant flash does not take here: the paged kernel serves them.
    capped = default.attention(q, cache.k, cache.v, cache.tables, seq, pos, scale, softcap=30.0)
    assert torch.equal(
        capped, invariant.attention(q, cache.k, cache.v, cache.tables, seq, pos, scale, softcap=30.0)
    )
