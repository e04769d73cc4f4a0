"""The launch state of one set of Triton kernels, owned by the `TritonKernels` that launches them.

Two things outlive a launch: whether kernels launch as programmatic dependents (dependent_launch.py), a switch
benchmarks turn off to price it, and the matmul's arrival counters, one zeroed set per device that every launch
splitting K among programs counts its slices in (matmul.py). Keeping them here, not in module globals, gives each
kernel set its own and lets a test or benchmark make a fresh one. None of it changes a result's bits.

Kernels launch through Triton's own launch path. Bypassing it for the matmul (reusing the compiled kernel without
Triton's per-call binding, on Triton's private launch API) was measured on served steps and did not pay: the steps
replayed from graphs took the same time, and graph captures and eager steps were slower with it
(bench/results/h200.md, "Choices the code rests on").
"""

from __future__ import annotations

import torch

from .dependent_launch import dependent_launch_supported

# Counters allocated at once, so that a decode step's launches never allocate.
_MIN_ARRIVALS = 1 << 14


class Launches:
    def __init__(self, *, dependent_launch: bool = True) -> None:
        # Whether kernels launch as programmatic dependents where the device supports it.
        self.dependent_launch = dependent_launch
        # Arrival counters per device, all zero between launches (a tile's last program resets its own). One set
        # serves every launch on the device, because the launches that use them run one after another: the backend
        # issues a device's kernels from one stream, and a graph's kernels run in stream order too.
        self.arrivals: dict[torch.device, torch.Tensor] = {}
        # Counters outgrown by a larger launch stay allocated: graphs captured earlier hold their address and
        # replay into it.
        self.outgrown: list[torch.Tensor] = []

    def dependent(self, device: torch.device) -> bool:
        """Whether kernels on `device` launch as programmatic dependents."""
        return self.dependent_launch and dependent_launch_supported(device)

    def arrival_counters(self, device: torch.device, tiles: int) -> torch.Tensor:
        """At least `tiles` zeroed int32 counters on `device`, for one launch."""
        counters = self.arrivals.get(device)
        if counters is not None and counters.numel() >= tiles:
            return counters
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # Memory allocated while a graph is captured is the graph's, and zeroed only when it replays: counters
            # made here are this launch's own (the graph zeroes them at each replay), never kept for other launches.
            return torch.zeros(tiles, device=device, dtype=torch.int32)
        if device in self.arrivals:
            self.outgrown.append(self.arrivals[device])
        counters = torch.zeros(max(tiles, _MIN_ARRIVALS), device=device, dtype=torch.int32)
        self.arrivals[device] = counters
        return counters
