"""Every Gluon tile the plans serve, and a swapped specialized tile of each number of partitions, compiles for Hopper
(sm_90a) on this machine, with no GPU: ptxas spills no register and warns of nothing unexpected (it once serialized the tensor-core steps of a tile, with a warning). CI has
no GPU, so this is where it sees the Gluon kernels' code; the GPU tests prove their bits
(tests/test_kernels_triton_gluon.py)."""

from __future__ import annotations

import importlib
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from pinned_backend.kernels.triton import plan_files  # noqa: E402
from pinned_backend.kernels.triton.matmul import _GROUP_M  # noqa: E402
from pinned_backend.kernels.triton.matmul_gluon_launch import GluonLaunch, gluon_launch  # noqa: E402
from pinned_backend.kernels.triton.matmul_plans import MatmulPlan, MatmulTile  # noqa: E402

# Swapped specialized tiles of each number of partitions, whether or not a plan serves them: the largest
# accumulators each allows, with and without a tail, and two slices of K. (N, K, slices, tile.)
_PARTITIONED = [
    (12288, 2048, 1, MatmulTile(64, 64, 64, 4, 8, swap=True, tail=32, gluon="specialized")),
    (2048, 6144, 2, MatmulTile(128, 128, 64, 4, 4, swap=True, gluon="specialized")),
    (12288, 2048, 1, MatmulTile(128, 192, 64, 4, 3, swap=True, tail=64, gluon="specialized")),
    (12288, 2048, 1, MatmulTile(64, 256, 64, 4, 3, swap=True, tail=32, gluon="specialized")),
]


def _launches() -> dict[str, GluonLaunch]:
    """Each distinct launch of a Gluon tile in the shipped plan files, as served steps make it (programmatic
    dependents), and of the swapped specialized tiles above."""
    launches: dict[str, GluonLaunch] = {}
    served = [
        (n, k, plan.split_k, tile)
        for shipped in plan_files.shipped()
        for (n, k), plan in shipped.plans.items()
        for _, tile in plan.tiles
        if tile.gluon
    ]
    for n, k, split, tile in served + _PARTITIONED:
        MatmulPlan(split, ((1 << 62, tile),)).check(k)
        launch = gluon_launch(tile, split, n, k, _GROUP_M, dependent=True)
        blocks = "-".join(f"{operand}{rows}x{cols}" for operand, (rows, cols) in launch.descriptors)
        constants = "-".join(f"{key}{value}" for key, value in sorted(launch.constants.items()))
        launches[f"{launch.kernel.fn.__name__.strip('_')}-{blocks}-{constants}"] = launch
    return launches


def _compile_ptx(launch: GluonLaunch) -> str:
    params = launch.kernel.arg_names
    descriptors = len(launch.descriptors)
    signature = {
        name: f"tensordesc<bf16[{rows}, {cols}],{gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)!r}>"
        for name, (_, (rows, cols)) in zip(params[:descriptors], launch.descriptors, strict=True)
    }
    signature |= dict(
        zip(params[descriptors : descriptors + 4], ["*fp32", "*i32", "i32", "i32"], strict=True)
    )
    signature |= {name: "constexpr" for name in params[descriptors + 4 :]}
    constants = {(params.index(name),): value for name, value in launch.constants.items()}
    options = {"num_warps": launch.constants["num_warps"]}
    if launch.maxnreg:
        options["maxnreg"] = launch.maxnreg
    source = GluonASTSource(launch.kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


LAUNCHES = _launches()


@pytest.mark.parametrize("name", sorted(LAUNCHES), ids=sorted(LAUNCHES))
def test_a_gluon_tile_compiles_for_hopper_with_no_spill_and_no_ptxas_warning(name: str) -> None:
    ptx = _compile_ptx(LAUNCHES[name])
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        report = subprocess.run(
            [
                get_ptxas(90).path,
                "-v",
                "--gpu-name=sm_90a",
                str(source),
                "-o",
                str(Path(folder) / "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    # Triton gives a warp-specialised kernel of 8 warps (the copying warp's group among them) a limit of 256
    # registers a thread, which ptxas ignores as it says (255 is its most, which the 8 warps' register file allows).
    # Any other warning is a failure.
    warnings = [line for line in report.splitlines() if "warning" in line.lower()]
    assert all(
        re.search(r"Too many maxnreg specified for entry _(swapped_)?specialized_kernel", w) for w in warnings
    ), report
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(stores == loads == "0" for stores, loads in spills), report


def test_a_swapped_specialized_gluon_tile_multiplies_each_64_weight_rows_in_a_warpgroup_of_its_own() -> None:
    tile = MatmulTile(128, 192, 64, 4, 4, swap=True, tail=16, gluon="specialized")
    MatmulPlan(1, ((1 << 62, tile),)).check(2048)
    assert tile.partitions == 3
    launch = gluon_launch(tile, 1, 12288, 2048, 8, dependent=True)
    assert launch.constants["PARTS"] == 3 and launch.constants["N_TILES"] == 64
    # Each partition copies and stores blocks of its own 64 weight rows.
    assert launch.descriptors == (
        ("w", (64, 64)),
        ("x", (128, 64)),
        ("x", (16, 64)),
        ("out", (128, 64)),
        ("out", (16, 64)),
    )
    assert MatmulTile(64, 128, 64, 4, 4, swap=True, gluon="pipelined").partitions == 0


@pytest.mark.parametrize(
    ("tile", "n", "k", "split", "m", "grid"),
    [
        # 3 row tiles of 128 + 16 rows by 64 tiles of 192 weight rows, walked by at most 132 programs.
        (
            MatmulTile(128, 192, 64, 4, 4, swap=True, tail=16, gluon="specialized"),
            12288,
            2048,
            1,
            384,
            (132, 1),
        ),
        # 5 row tiles by 32, a program for each tile's each slice of K.
        (
            MatmulTile(64, 64, 64, 4, 8, split_programs=True, gluon="specialized"),
            2048,
            6144,
            2,
            264,
            (160, 2),
        ),
        # 5 row tiles by 32, walked by at most 132 programs.
        (MatmulTile(128, 128, 64, 8, 5, gluon="persistent"), 4096, 2048, 1, 600, (132, 1)),
        # 3 row tiles of 64 + 32 rows by 32, a program each.
        (MatmulTile(64, 64, 128, 4, 5, swap=True, tail=32, gluon="pipelined"), 2048, 6144, 2, 264, (96, 1)),
    ],
)
def test_launch_gluon_launches_gluon_launch_s_kernel_over_the_tiles(
    monkeypatch: pytest.MonkeyPatch,
    tile: MatmulTile,
    n: int,
    k: int,
    split: int,
    m: int,
    grid: tuple[int, int],
) -> None:
    kernels = importlib.import_module("pinned_backend.kernels.triton.matmul_gluon")
    swapped = importlib.import_module("pinned_backend.kernels.triton.matmul_gluon_swapped")
    launch_module = importlib.import_module("pinned_backend.kernels.triton.matmul_gluon_launch")
    launched: list[tuple[Any, ...]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, int]) -> Any:
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    for module, kernel in (
        (kernels, "_specialized_kernel"),
        (kernels, "_pipelined_kernel"),
        (swapped, "_swapped_kernel"),
        (swapped, "_swapped_specialized_kernel"),
    ):
        monkeypatch.setattr(module, kernel, Recorder())
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    out = torch.zeros(m, n, dtype=torch.bfloat16)
    launch_module.launch_gluon(x, w, out, split, tile, _GROUP_M, 132, out, out)
    expected = gluon_launch(tile, split, n, k, _GROUP_M, dependent=False)
    [(launched_grid, args, kwargs)] = launched
    assert launched_grid == grid
    assert [list(d.block_shape) for d in args[: len(expected.descriptors)]] == [
        list(block) for _, block in expected.descriptors
    ]
    assert args[len(expected.descriptors) + 2 :] == (m, n)
    assert {key: kwargs[key] for key in expected.constants} == expected.constants | {"PDL": kwargs["PDL"]}
