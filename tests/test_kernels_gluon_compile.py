"""Every Gluon tile the plans serve compiles for Hopper (sm_90a) on this machine, with no GPU: ptxas spills no
register and warns of nothing unexpected (it once serialized the tensor-core steps of a tile, with a warning). CI has
no GPU, so this is where it sees the Gluon kernels' code; the GPU tests prove their bits
(tests/test_kernels_triton_gluon.py)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from pinned_backend.kernels.triton.matmul import _GROUP_M  # noqa: E402
from pinned_backend.kernels.triton.matmul_gluon import GluonLaunch, gluon_launch  # noqa: E402
from pinned_backend.kernels.triton.matmul_plans import TUNED  # noqa: E402


def _served() -> dict[str, GluonLaunch]:
    """Each distinct launch of a Gluon tile in the tuned plans, as served steps make it (programmatic dependents)."""
    launches: dict[str, GluonLaunch] = {}
    for (n, k), plan in TUNED.items():
        for _, tile in plan.tiles:
            if tile.gluon:
                launch = gluon_launch(tile, plan.split_k, n, k, _GROUP_M, dependent=True)
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


SERVED = _served()


@pytest.mark.parametrize("name", sorted(SERVED), ids=sorted(SERVED))
def test_a_served_gluon_tile_compiles_for_hopper_with_no_spill_and_no_ptxas_warning(name: str) -> None:
    ptx = _compile_ptx(SERVED[name])
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
    # Triton gives a warp-specialised kernel of 8 warps a limit of 256 registers a thread, which ptxas ignores as it
    # says (255 is its most, which the 8 warps' register file allows). Any other warning is a failure.
    warnings = [line for line in report.splitlines() if "warning" in line.lower()]
    assert all(re.search(r"Too many maxnreg specified for entry _specialized_kernel", w) for w in warnings), (
        report
    )
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(stores == loads == "0" for stores, loads in spills), report
