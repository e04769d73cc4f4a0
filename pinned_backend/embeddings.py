"""Embeddings: one vector per input, pooled from the model's final hidden states, with the same bits whatever
else the request or the server holds.

Each input is prefilled on its own, in chunks of the step budget as the engine prefills a prompt, into KV blocks
it borrows from the engine's cache for as long as that input takes, and never shares a forward pass with anything
else. Every shape its passes take is then a function of its own length, so its vector is a function of its own
tokens (and the stack) alone, in either kernel mode: not of the other inputs of its request, nor of what the
engine decodes between its passes. The hidden states of its tokens are pooled as the stack's `embedding` says
(`last_token`: the last token's; `mean`: their mean, summed in float64 in token order), optionally cut to the
first `dimensions` components, and scaled to unit L2 norm in float64 before rounding to float32 once.

A job runs on the engine's thread between its steps (`EngineRunner.add_chore`), one forward pass per turn, so a
long input never holds up the decode steps of others for more than one pass. This module knows nothing of HTTP or
tokenizers; it borrows the engine's model, cache and allocator and leaves the engine's scheduling alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pinned_backend.engine import Allocator, EngineError, RequestTooLarge
from pinned_backend.kvcache import block_table
from pinned_backend.model import Transformer


@dataclass(frozen=True)
class Pooling:
    """How a sequence's hidden states become one vector, and the limits of the cache its passes run in."""

    method: str  # "last_token" or "mean"
    chunk_tokens: int  # tokens per forward pass, the engine's step budget
    block_size: int
    usable_blocks: int  # the most blocks one input may borrow
    max_len: int  # the model's context

    def check(self, index: int, ids: list[int]) -> None:
        """Raises `RequestTooLarge` for an input that could never be embedded here."""
        if not ids:
            raise RequestTooLarge(f"input {index} has no tokens")
        if len(ids) > self.max_len:
            raise RequestTooLarge(
                f"input {index} has {len(ids)} tokens; the model's context is {self.max_len}: shorten it"
            )
        if -(-len(ids) // self.block_size) > self.usable_blocks:
            raise RequestTooLarge(
                f"input {index} has {len(ids)} tokens, more than this server's KV cache holds "
                f"({self.usable_blocks * self.block_size}); shorten it"
            )


def pool(hidden: torch.Tensor, method: str, dimensions: int | None) -> torch.Tensor:
    """[L, hidden] -> [dimensions or hidden] float32 of unit L2 norm."""
    if method == "last_token":
        vector = hidden[-1].double()
    else:
        vector = torch.zeros(hidden.shape[1], dtype=torch.float64, device=hidden.device)
        for row in hidden.double():  # one token at a time: a fixed order of the sum, whatever the length
            vector += row
        vector /= hidden.shape[0]
    if dimensions is not None:
        vector = vector[:dimensions]
    norm = torch.linalg.vector_norm(vector)
    if norm > 0:
        vector = vector / norm
    return vector.float().cpu()


Done = Callable[[list[torch.Tensor] | EngineError], None]


@dataclass(eq=False)
class EmbeddingJob:
    """The inputs of one request, embedded one forward pass per `advance`; `done` gets the vectors or an error."""

    model: Transformer  # its hidden_states, which forward reads the logits from
    cache: Any
    allocator: Allocator
    device: torch.device
    pooling: Pooling
    inputs: list[list[int]]
    dimensions: int | None
    done: Done
    vectors: list[torch.Tensor] = field(default_factory=list)
    cancelled: bool = False  # set from another thread: the client left; the job ends at its next turn
    _blocks: list[int] = field(default_factory=list)
    _computed: int = 0
    _states: list[torch.Tensor] = field(default_factory=list)

    def advance(self) -> bool:
        """One forward pass over the next chunk of the current input; True once every input is embedded.

        An input borrows the blocks of its whole length at its first pass; while the cache has no room for them
        (the engine's running requests hold them), the job waits for a later turn."""
        if self.cancelled:
            self.release()
            return True
        ids = self.inputs[len(self.vectors)]
        if not self._blocks:
            needed = -(-len(ids) // self.pooling.block_size)
            if needed > self.allocator.free_blocks:
                return False
            self._blocks = self.allocator.allocate(needed)
        start, end = self._computed, min(len(ids), self._computed + self.pooling.chunk_tokens)
        try:
            with torch.inference_mode():
                self._states.append(self._pass(ids, start, end))
        except BaseException:
            self.release()
            raise
        self._computed = end
        if end < len(ids):
            return False
        hidden = torch.cat(self._states) if self.pooling.method == "mean" else self._states[-1]
        self.vectors.append(pool(hidden, self.pooling.method, self.dimensions))
        self.release()
        if len(self.vectors) < len(self.inputs):
            return False
        self.done(self.vectors)
        return True

    def _pass(self, ids: list[int], start: int, end: int) -> torch.Tensor:
        n = end - start
        # Last-token pooling reads the final chunk's last row; the earlier chunks' last rows are computed and
        # dropped rather than asking the kernels for no rows at all.
        rows = range(n) if self.pooling.method == "mean" else range(n - 1, n)
        dev = self.device
        hidden = self.model.hidden_states(
            torch.tensor(ids[start:end], dtype=torch.int64, device=dev),
            torch.zeros(n, dtype=torch.int32, device=dev),
            torch.arange(start, end, dtype=torch.int32, device=dev),
            block_table([self._blocks], 1, len(self._blocks)).to(dev),
            self.cache,
            torch.tensor(list(rows), dtype=torch.int64, device=dev),
        )
        return hidden.float()

    def release(self) -> None:
        """Gives the borrowed blocks back and forgets the current input's partial state."""
        if self._blocks:
            self.allocator.free(self._blocks)
        self._blocks, self._computed, self._states = [], 0, []

    def fail(self, error: EngineError) -> None:
        self.release()
        self.done(error)
