"""Decode steps replayed as CUDA graphs, padded to a few captured batch sizes.

A decode step of a real model launches hundreds of small kernels; replayed from a graph, they run without the
host's launch gaps. A graph has fixed shapes, so a step of b sequences runs in the graph of the next captured size
and of the next captured block-table width, and the rows past b decode a dummy token into one scratch cache block
that no sequence owns. Padding is sound only under batch-invariant kernels: a row's bits do not depend on how many
rows share its step, so a padded step gives every real row what an unpadded one would (tests/test_decode_graphs.py
proves it on the CPU, padding eagerly, and on a GPU with graphs). Under other kernels the engine does not use this.

This module knows nothing of scheduling or sampling: it takes one step's tokens, positions and block lists and
returns their logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Batch sizes captured, up to the engine's largest batch (which is always captured too). Each captured size costs
# one graph's activations; the gaps bound the padding to 3 rows in 8 (a step of 5 runs as 8).
GRAPH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Block-table widths captured: powers of two from this up to the model's whole context. Attention launches work
# (and sizes its workspace) by the table's width, so a short step should not carry a 40,960-token table.
MIN_TABLE_WIDTH = 16


class DecodeGraphs:
    def __init__(
        self,
        model: Any,
        cache: Any,
        scratch_block: int,
        max_batch: int,
        table_width: int,
        device: torch.device,
        capture: bool,
    ) -> None:
        """`scratch_block`: a cache block reserved for padding rows. `capture`: replay CUDA graphs (on a GPU);
        without it the padded step runs eagerly, which is how the CPU tests check that padding is harmless."""
        self.model, self.cache, self.device, self.capture = model, cache, device, capture
        self.scratch_block = scratch_block
        self.sizes = [s for s in GRAPH_SIZES if s < max_batch] + [max_batch]
        self.table_width = table_width
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.seq = torch.arange(max_batch, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.tables = torch.zeros((max_batch, table_width), dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.steps = 0  # decode steps run here, the padding rows they carried and their (size, width) shapes
        self.padded_rows = 0
        self.shapes: set[tuple[int, int]] = set()
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def size_for(self, batch: int) -> int:
        if not 1 <= batch <= self.sizes[-1]:
            raise ValueError(f"a decode step of {batch} sequences; this engine runs 1..{self.sizes[-1]}")
        return next(s for s in self.sizes if s >= batch)

    def width_for(self, blocks: int) -> int:
        """The captured table width for a step whose longest sequence holds `blocks` cache blocks."""
        width = MIN_TABLE_WIDTH
        while width < blocks:
            width *= 2
        return min(width, self.table_width)

    def forward(
        self, tokens: Sequence[int], positions: Sequence[int], blocks: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """Logits [b, vocab] (float32) of one decode step: sequence i feeds `tokens[i]` at `positions[i]`, its
        cache in `blocks[i]`. The result is a view that the next call overwrites."""
        batch = len(tokens)
        size = self.size_for(batch)
        width = self.width_for(max(len(owned) for owned in blocks))
        self.steps += 1
        self.padded_rows += size - batch
        self.shapes.add((size, width))
        # Built on the host and copied in once each: the graph reads these buffers in place.
        table = torch.zeros((size, width), dtype=torch.int32)
        for i, owned in enumerate(blocks):
            table[i, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        table[batch:, 0] = self.scratch_block
        padded_tokens = torch.zeros(size, dtype=torch.int64)
        padded_tokens[:batch] = torch.tensor(tokens, dtype=torch.int64)
        padded_pos = torch.zeros(size, dtype=torch.int32)
        padded_pos[:batch] = torch.tensor(positions, dtype=torch.int32)
        self.tables[:size, :width].copy_(table)
        self.tokens[:size].copy_(padded_tokens)
        self.pos[:size].copy_(padded_pos)
        if not self.capture:
            return self._run(size, width)[:batch]
        graph, logits = self._graphs.get((size, width)) or self._capture(size, width)
        graph.replay()
        return logits[:batch]

    def _run(self, size: int, width: int) -> torch.Tensor:
        return self.model.forward(  # type: ignore[no-any-return]
            self.tokens[:size],
            self.seq[:size],
            self.pos[:size],
            self.tables[:size, :width],
            self.cache,
            self.rows[:size],
        )

    def _capture(self, size: int, width: int) -> tuple[Any, torch.Tensor]:
        # One eager run first, on a side stream as capture wants: it compiles the kernels and settles the allocator
        # outside the graph. It computes this very step, so what it writes to the cache is what the replay writes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(size, width)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._run(size, width)
        self._graphs[(size, width)] = (graph, logits)
        return graph, logits
