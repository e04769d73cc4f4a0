"""Timing a matmul on the GPU as a decode step meets it: its weight read from memory, its launches in a CUDA graph.

Each timed call takes the next of several copies of the weight, together far larger than L2, so that it reads the
weight from memory as consecutive layers of a step do; all the calls are captured in one graph, so that launch gaps
stay out (a served step replays a graph too). Several functions are timed in turn, replay by replay, so that their
medians come from the same stretch of the GPU's clocks, which drift by a few percent within a run: timed one after
the other, a tile at one size once took 5% longer in the second of two checks and cuBLAS 2%. Used by the tuner and
by the GPU benchmarks; it knows nothing of plans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# Weight copies cycled per timing: four times the H200's 50 MiB of L2.
ROTATE_BYTES = 200 << 20


def weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `w` that together far exceed L2 (2 to 32 of them)."""
    n = max(2, min(32, -(-ROTATE_BYTES // (w.numel() * w.element_size()))))
    return [w.clone() for _ in range(n)]


def time_interleaved(
    fns: Sequence[Callable[[torch.Tensor, torch.Tensor], Any]],
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    replays: int = 5,
) -> list[float]:
    """Microseconds per `fn(x, w)` for each of `fns`, w cycling through `weights`: each function's calls captured in
    one graph, the graphs replayed in turn `replays` times, the median of each."""
    graphs = []
    for fn in fns:
        for w in weights[:2]:
            fn(x, w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                fn(x, w)
        graph.replay()
        graphs.append(graph)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(replays):
        for graph, taken in zip(graphs, times, strict=True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            taken.append(start.elapsed_time(end) * 1e3 / len(weights))
    del graphs
    return [sorted(taken)[len(taken) // 2] for taken in times]


def time_alone(
    fn: Callable[[torch.Tensor, torch.Tensor], Any], x: torch.Tensor, weights: Sequence[torch.Tensor]
) -> float:
    """`time_interleaved` of one function."""
    return time_interleaved([fn], x, weights)[0]
