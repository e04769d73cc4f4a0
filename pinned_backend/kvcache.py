"""The paged KV cache: fixed-size blocks of keys and values per layer, and the allocator that hands blocks
out.

A sequence owns a list of block ids (its row of the engine's block table); position p of the sequence lives
in block `table[p // block_size]` at offset `p % block_size`. This module owns the memory and the
bookkeeping of free blocks; which sequence holds which blocks, and when to evict, is the engine's business.
The model writes each step's keys and values into the cache before attention reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pinned_backend.checkpoint import ModelConfig


class CacheFull(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated."""


class PagedKVCache:
    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        # Zeros, not empty: attention multiplies masked slots by 0, and 0 * NaN from garbage memory is NaN.
        # k[layer], v[layer]: [num_blocks, block_size, n_kv_heads, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * config.kv_size * element

    @staticmethod
    def blocks_for_budget(config: ModelConfig, budget_bytes: int, block_size: int, dtype: torch.dtype) -> int:
        """How many blocks fit in `budget_bytes`; a ValueError if not even one does."""
        per_block = PagedKVCache.bytes_per_block(config, block_size, dtype)
        blocks = budget_bytes // per_block
        if blocks < 1:
            raise ValueError(
                f"a KV cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
                f"takes {per_block} bytes for this model; raise the budget"
            )
        return blocks

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        # slots [T] int64 = block * block_size + offset; keys, values [T, n_kv_heads, head_dim]
        self.k[layer].view(-1, *keys.shape[1:])[slots] = keys.to(self.dtype)
        self.v[layer].view(-1, *values.shape[1:])[slots] = values.to(self.dtype)


def block_table(blocks: Sequence[Sequence[int]], rows: int, width: int) -> torch.Tensor:
    """The block table of a step on the host, int32 [rows, width]: row i lists `blocks[i]`; the rest is zeros."""
    table = torch.zeros((rows, width), dtype=torch.int32)
    for row, owned in enumerate(blocks):
        table[row, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
    return table


class BlockAllocator:
    """Hands out block ids, lowest first, so that a given sequence of requests always gets the same blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest id is popped first
        self._used: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise CacheFull(f"asked for {n} KV cache blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        unknown = [b for b in blocks if b not in self._used]
        if unknown or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks that are not allocated (or twice): {unknown or blocks}")
        self._used.difference_update(blocks)
        self._free.extend(blocks)
        self._free.sort(reverse=True)
