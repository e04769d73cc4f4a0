"""Programmatic dependent launch: on Hopper and later, a kernel of a step may start before the one it follows ends.

A decode step is a chain of some 300 short kernels, and each one used to pay its launch, its programs' start and
its first memory round trips after the last program of the one before had finished, while most of the chip sat
idle in that one's tail. With programmatic dependent launch, every kernel here starts with `start_as_dependent`:
it lets the next one launch, then waits until the kernel before it has finished and its writes are visible, and
only then reads anything that an earlier kernel wrote. So the next kernel's launch and the start of
its programs overlap the previous kernel's tail. (Pulling the matmul's weight into L2 before the wait was tried as
well and made a batch-1 decode step slower, 1.58 -> 1.66 ms on an H200: the prefetch competes with the tail it is
meant to hide.)

The rule that keeps this correct: every kernel launched with `launch_pdl` calls `start_as_dependent` in every
program before its first read of activations, caches, positions or tables, and before its first write; and the
kernel is compiled to wait exactly when it is launched as a dependent, which `launch_options` gives as one pair. A kernel's wait
returns only once its predecessor has completed, and that one completed only after its own wait, so the order
holds along the whole chain; kernels launched without the attribute (torch's, cuBLAS's) wait as always. None of this
touches arithmetic: the bits of every output are those of launching one kernel after the other, which the GPU tests
check (graph replays against eager steps, and every kernel against itself across batch sizes).
"""

from __future__ import annotations

import functools

import torch

from ._compat import HAVE_TRITON, interpreted, tl, triton

if HAVE_TRITON:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.cache
def _supported(device_index: int) -> bool:
    if not HAVE_TRITON or interpreted() or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch as programmatic dependents: a CUDA device of Hopper or later, with
    Triton compiling (not interpreting) the kernels."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, wanted: bool = True) -> dict[str, bool]:
    """A kernel's launch arguments for dependent launch on `device`: its PDL constexpr (whether it waits) and
    Triton's `launch_pdl` (whether it is launched as a dependent), which must agree or the kernel races. Dependent
    where the device supports it, unless not `wanted` (benchmarks that price it; the bits are the same)."""
    enabled = wanted and dependent_launch_supported(device)
    return {"PDL": enabled, "launch_pdl": enabled}


@triton.jit
def start_as_dependent(PDL: tl.constexpr):
    """Let the next kernel of the stream launch now, then block until the kernel before this one has finished and
    its writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
