"""The paged KV cache: fixed-size blocks of keys and values per layer, and the allocator that hands blocks out,
shares them by reference count and keeps full ones addressable by their content.

A sequence owns a list of block ids (its row of the engine's block table); position p of the sequence lives
in block `table[p // block_size]` at offset `p % block_size`. The model writes each step's keys and values into
the cache before attention reads them.

The prefix cache lives in the allocator. A block whose every position holds a computed token can be published under
its key, `block_key(parent key, the block's token ids)`: a chain of hashes from the sequence's first block, so a
key names the whole prefix up to the block's end and nothing else (not the request, its sampling, nor the step).
Another request whose prompt starts with the same tokens finds those blocks by their keys and shares them, each
held by a reference count. A block that nobody holds any more stays cached, idle, and is reused for new blocks
only when no free block is left, least recently used first; `free_blocks` counts the idle ones, since they can be
taken at any moment. The KV cache's one memory budget thus holds both the running requests and the cache.

Why a shared block serves a new request the very bits it would compute cold is the engine's argument
(engine.py); this module only keeps the bookkeeping exact: a published block is never handed out as a fresh
one while anyone holds it, and a key always names the block that was published under it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from pinned_backend.checkpoint import ModelConfig

# The KV cache's size when none is given: room for this many sequences of the model's whole context, but at most
# this share of the memory left once the weights are loaded (memory.py), for the steps' activations and the rest.
KV_CONTEXTS = 4
KV_MEMORY_SHARE = 0.25


def automatic_budget(config: ModelConfig, dtype: torch.dtype, available_bytes: int) -> int:
    """The KV cache's size in bytes when none is given (`--kv-cache-mb auto`)."""
    per_token = PagedKVCache.bytes_per_block(config, 1, dtype)
    whole_contexts = per_token * config.max_position_embeddings * KV_CONTEXTS
    return min(whole_contexts, int(available_bytes * KV_MEMORY_SHARE))


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
        heads, key_width, value_width = config.cache_shape
        # Zeros, not empty: attention multiplies masked slots by 0, and 0 * NaN from garbage memory is NaN.
        # k[layer], v[layer]: [num_blocks, block_size, n_kv_heads, head_dim]. Latent attention keeps one row per token
        # (its latent and its rotated key) that is both key and value: v[layer] is k[layer].
        layers = range(config.num_hidden_layers)
        self.k = [
            torch.zeros((num_blocks, block_size, heads, key_width), dtype=dtype, device=device)
            for _ in layers
        ]
        self.v = (
            [
                torch.zeros((num_blocks, block_size, heads, value_width), dtype=dtype, device=device)
                for _ in layers
            ]
            if value_width
            else self.k
        )

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        heads, key_width, value_width = config.cache_shape
        return config.num_hidden_layers * block_size * heads * (key_width + value_width) * element

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


ROOT_KEY = b""  # the parent key of a sequence's first block


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content address of a full block: SHA-256 over its parent's key and its token ids, so that equal keys
    mean equal prefixes (a collision would need SHA-256 to collide)."""
    digest = hashlib.sha256(parent)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


def block_keys(tokens: Sequence[int], block_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """The keys of every full block of `tokens`, a sequence's first block first."""
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys


class BlockAllocator:
    """Hands out block ids, lowest first, so that a given sequence of requests always gets the same blocks; keeps
    published blocks under their keys while held, and idle afterwards until a fresh block needs their room."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest id is popped first
        self._refs: dict[int, int] = {}  # held blocks and how many hold each
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks nobody holds, least recently used first

    @property
    def free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks published under a key, held or idle."""
        return len(self._by_key)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each held once: free ones first, then idle cached ones, least recently used first."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.free_blocks:
            raise CacheFull(
                f"asked for {n} KV cache blocks, {self.free_blocks} of {self.num_blocks} are free"
            )
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._by_key[self._key_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one hold on each block. A block nobody holds goes back: idle and still cached if it was published,
        else free. Given a sequence's blocks in order, its last block becomes the least recently used of them, so
        that eviction takes a prefix's tail before its head (a head whose tail went is still a hit; a tail whose head
        went is unreachable)."""
        unknown = [b for b in blocks if b not in self._refs]
        if unknown or len(set(blocks)) != len(blocks):
            raise ValueError(f"freeing blocks that are not allocated (or twice): {unknown or list(blocks)}")
        released = False
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
                released = True
        if released:
            self._free.sort(reverse=True)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, each now held once more (an idle one
        leaves the idle list); `free` them to let go."""
        blocks = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if block in self._idle:
                del self._idle[block]
                self._refs[block] = 1
            else:
                self._refs[block] += 1
        return blocks

    def publish(self, block: int, key: bytes) -> bool:
        """Cache a held, full block under `key`; False (and nothing changes) when the key names a block already,
        as when two requests computed the same prefix side by side, or the block has a key already."""
        if block not in self._refs:
            raise ValueError(f"publishing block {block}, which nobody holds")
        if key in self._by_key or block in self._key_of:
            return False
        self._by_key[key] = block
        self._key_of[block] = key
        return True
