"""Steps replayed as CUDA graphs, padded to a few captured shapes: decode, prefill and mixed steps alike.

A step of a real model launches hundreds of small kernels, and launched one by one from Python it waits on the
host: on the H200's hosts, an eager step of one 512-token prompt spent 9 to 21 ms launching some 300 kernels for
about 2.3 ms of arithmetic (bench/results/h200.md). Replayed from a graph, the kernels run back to back. A graph
has fixed shapes, so a step runs in the graph of the next captured shape up:
- sequences: the next of `SEQUENCE_SIZES` (padding decode rows costs little: a decode step reads the weights once
  whatever its rows);
- tokens: a decode-only step (one token per sequence) has as many as its sequences; any other step takes the next
  of `token_sizes`, a quarter of an octave apart from 16 on, so that padding a step of more than 12 tokens (one
  that may be bound by arithmetic) adds at most a quarter of its rows;
- block-table width: the next power of two from `MIN_TABLE_WIDTH`, up to the model's whole context (attention
  sizes its work by the table's width, so a short step should not carry a 40,960-token table);
- logits rows: one per sequence, or, for a step that wants more (a speculative verify pass wants one per token it
  verifies), the next of `token_sizes` up, within the step's tokens.

Padding tokens feed token 0 at position 0 of a sequence of their own, the table's last row, which holds one
scratch cache block that no request owns; padding logits rows repeat the step's last token. Under batch-invariant
kernels padding changes no bit: a row's bits do not depend on how many rows share its step, so a padded step gives
every real row what an unpadded one would (tests/test_step_graphs.py proves it on the CPU, padding eagerly, and on
a GPU with graphs). Under `default` kernels a padded step may round a row otherwise, as any other batch may: the
mode promises no bits, and replaying graphs is how it runs at its fastest.

Graphs are captured as steps first need them, and at most `max_graphs` are kept, the least recently used dropped
first. They share one memory pool, since only one replays at a time, and write their logits into one buffer.

This module knows nothing of scheduling or sampling: it takes one step's tokens, positions, block lists and logits
rows, and returns those rows' logits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pinned_backend.kvcache import block_table

# Sequence counts captured, up to the engine's largest batch (which is always captured too).
SEQUENCE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_TABLE_WIDTH = 16
# Each kept graph costs its kernels' parameters and a capture (about one eager step) when first needed; the
# activations of all of them share one pool.
DEFAULT_MAX_GRAPHS = 64

# How a step ran: replayed from a graph, captured into one first, or (without capture, on the CPU) eagerly.
StepLaunch = Literal["graph", "capture", "eager"]


def token_sizes(limit: int) -> list[int]:
    """The token counts captured for steps that are not decode-only, up to `limit` (always captured too)."""
    sizes = [1, 2, 4, 8, 12]
    size = 16
    while size < limit:
        sizes.append(size)
        size += 1 << (size.bit_length() - 3)  # a quarter of the octave that `size` starts
    return [s for s in sizes if s < limit] + [limit]


@dataclass(frozen=True)
class StepShape:
    """A captured step: its padded token count, sequence count and block-table width."""

    tokens: int
    sequences: int
    width: int
    rows: int = 0  # logits rows; 0 means one per sequence


class StepGraphs:
    def __init__(
        self,
        model: Any,
        cache: Any,
        scratch_block: int,
        max_batch: int,
        max_tokens: int,
        table_width: int,
        device: torch.device,
        capture: bool,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_rows: int | None = None,
    ) -> None:
        """`scratch_block`: a cache block reserved for padding tokens. `max_batch`, `max_tokens`: the most sequences
        and tokens a step may have; `max_rows`: the most logits rows (default one per sequence). `capture`: replay
        CUDA graphs (on a GPU); without it the padded step runs eagerly, which is how the CPU tests check that padding
        is harmless."""
        if max_tokens < max_batch:
            raise ValueError(
                f"a step of {max_batch} sequences needs at least {max_batch} tokens, not {max_tokens}"
            )
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, not {max_graphs}")
        self.model, self.cache, self.device, self.capture = model, cache, device, capture
        self.scratch_block, self.max_graphs = scratch_block, max_graphs
        self.sequence_sizes = [s for s in SEQUENCE_SIZES if s < max_batch] + [max_batch]
        self.token_sizes = token_sizes(max_tokens)
        self.table_width = table_width
        self.max_rows = max(max_batch, min(max_rows or max_batch, max_tokens))
        # The graphs read these in place: each step copies its inputs in, once each.
        self.tokens = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.seq = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.pos = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.tables = torch.zeros((max_batch + 1, table_width), dtype=torch.int32, device=device)
        self.rows = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
        self.logits: torch.Tensor | None = None  # [max_rows, vocab] float32, made at the first capture
        self._graphs: OrderedDict[StepShape, Any] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        # What ran here: steps, the padding they carried, the shapes they took, and graphs captured.
        self.steps = 0
        self.padded_tokens = 0
        self.padded_sequences = 0
        self.shapes: set[StepShape] = set()
        self.captures = 0
        # The last step's launch and padding tokens, for the engine's step statistics.
        self.last_launch: StepLaunch = "eager"
        self.last_padding = 0

    def shape_for(self, tokens: int, sequences: int, blocks: int, rows: int = 0) -> StepShape:
        """The captured shape of a step of `tokens` tokens over `sequences` sequences, the longest holding
        `blocks` cache blocks, that wants the logits of `rows` of its tokens."""
        padded_sequences = _next_size(self.sequence_sizes, sequences, "sequences")
        if tokens == sequences:  # decode-only, or prompts of one token: tokens follow sequences
            padded_tokens = padded_sequences
        else:
            padded_tokens = _next_size(self.token_sizes, tokens, "tokens")
        if blocks > self.table_width:
            raise ValueError(
                f"a sequence of {blocks} cache blocks; this engine's tables hold {self.table_width}"
            )
        width = MIN_TABLE_WIDTH
        while width < blocks:
            width *= 2
        if rows > min(tokens, self.max_rows):
            raise ValueError(
                f"{rows} logits rows of a step of {tokens} tokens; this engine takes {self.max_rows}"
            )
        padded_rows = 0
        if rows > padded_sequences:
            padded_rows = min(_next_size(self.token_sizes, rows, "logits rows"), padded_tokens, self.max_rows)
        return StepShape(padded_tokens, padded_sequences, min(width, self.table_width), padded_rows)

    def forward(
        self,
        token_ids: Sequence[int],
        query_seq: Sequence[int],
        query_pos: Sequence[int],
        blocks: Sequence[Sequence[int]],
        logits_rows: Sequence[int],
    ) -> torch.Tensor:
        """Logits [len(logits_rows), vocab] (float32) of one step: token i is `token_ids[i]` at `query_pos[i]` of
        sequence `query_seq[i]`, whose cache is `blocks[query_seq[i]]`; `logits_rows` are the tokens whose logits
        are wanted, in order. The result is a view that the next call overwrites."""
        n_tokens, n_seqs = len(token_ids), len(blocks)
        shape = self.shape_for(n_tokens, n_seqs, max(len(owned) for owned in blocks), len(logits_rows))
        self.steps += 1
        self.last_padding = shape.tokens - n_tokens
        self.padded_tokens += self.last_padding
        self.padded_sequences += shape.sequences - n_seqs
        self.shapes.add(shape)
        self._copy_in(shape, token_ids, query_seq, query_pos, blocks, logits_rows)
        if not self.capture:
            self.last_launch = "eager"
            return self._run(shape)[: len(logits_rows)]
        graph = self._graphs.get(shape)
        if graph is None:
            self.last_launch = "capture"
            graph = self._capture(shape)
        else:
            self.last_launch = "graph"
            self._graphs.move_to_end(shape)
        graph.replay()
        assert self.logits is not None
        return self.logits[: len(logits_rows)]

    def _copy_in(
        self,
        shape: StepShape,
        token_ids: Sequence[int],
        query_seq: Sequence[int],
        query_pos: Sequence[int],
        blocks: Sequence[Sequence[int]],
        logits_rows: Sequence[int],
    ) -> None:
        # Built on the host, then copied in once each.
        n = len(token_ids)
        padding_seq = shape.sequences
        table = block_table(blocks, shape.sequences + 1, shape.width)
        table[padding_seq, 0] = self.scratch_block
        tokens = torch.zeros(shape.tokens, dtype=torch.int64)
        tokens[:n] = torch.tensor(token_ids, dtype=torch.int64)
        seq = torch.full((shape.tokens,), padding_seq, dtype=torch.int32)
        seq[:n] = torch.tensor(query_seq, dtype=torch.int32)
        pos = torch.zeros(shape.tokens, dtype=torch.int32)
        pos[:n] = torch.tensor(query_pos, dtype=torch.int32)
        rows = torch.full((_rows(shape),), shape.tokens - 1, dtype=torch.int64)
        rows[: len(logits_rows)] = torch.tensor(logits_rows, dtype=torch.int64)
        self.tables[: shape.sequences + 1, : shape.width].copy_(table)
        self.tokens[: shape.tokens].copy_(tokens)
        self.seq[: shape.tokens].copy_(seq)
        self.pos[: shape.tokens].copy_(pos)
        self.rows[: _rows(shape)].copy_(rows)

    def _run(self, shape: StepShape) -> torch.Tensor:
        return self.model.forward(  # type: ignore[no-any-return]
            self.tokens[: shape.tokens],
            self.seq[: shape.tokens],
            self.pos[: shape.tokens],
            self.tables[: shape.sequences + 1, : shape.width],
            self.cache,
            self.rows[: _rows(shape)],
        )

    def _capture(self, shape: StepShape) -> Any:
        # One eager run first, on a side stream as capture wants: it compiles the kernels and settles the allocator
        # outside the graph. It computes this very step, so what it writes to the cache is what the replay writes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._run(shape)
        torch.cuda.current_stream().wait_stream(side)
        if self.logits is None:
            self.logits = torch.empty(
                (self.rows.shape[0], logits.shape[1]), dtype=logits.dtype, device=self.device
            )
        del logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            # The step's own logits are scratch of the pool; the rows copied out are what outlives the replay.
            self.logits[: _rows(shape)].copy_(self._run(shape))
        self._graphs[shape] = graph
        self.captures += 1
        # Dropped only now, so that the pool always has a graph using it (a capture joins a pool in use).
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return graph


def _rows(shape: StepShape) -> int:
    return shape.rows or shape.sequences


def _next_size(sizes: Sequence[int], n: int, what: str) -> int:
    if not 1 <= n <= sizes[-1]:
        raise ValueError(f"a step of {n} {what}; this engine runs 1..{sizes[-1]}")
    return next(s for s in sizes if s >= n)
