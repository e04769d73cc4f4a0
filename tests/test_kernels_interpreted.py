"""Specification of the GPU matmul's bookkeeping, checked on the CPU under Triton's interpreter: however a launch
cuts the work between programs (a slice of K per program, or equal runs of K steps with chains carried from one
program to the next) and however it loads its operands (plain loads or the copy engine's descriptors), every element
gets the bits of one program per tile; and that the grouped expert matmul gives each row its expert's product, the
same bits whatever the other rows went to; and that the attention variants (sliding windows, soft-caps, sinks), the
latent attention, GeGLU, the per-head matmul and biased experts compute their functions with a row's bits its own.
Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def test_every_way_of_cutting_a_matmul_between_programs_gives_one_programs_bits() -> None:
    run_interpreted("tests.support.interpreted_kernels")


def test_a_grouped_expert_matmuls_row_does_not_depend_on_how_the_step_spread_over_the_experts() -> None:
    run_interpreted("tests.support.interpreted_expert_matmul")


def run_interpreted(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        # A carry never passed on would leave a program waiting for it; the bound is generous because the
        # interpreter runs many times slower on a busy machine, and only a hang should fail here.
        timeout=1200,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_attention_variants_latent_attention_and_the_families_kernels_are_right_and_row_invariant() -> (
    None
):
    run_interpreted("tests.support.interpreted_attention")
