"""Specification of the paged KV cache and its block allocator."""

from __future__ import annotations

import pytest
import torch

from pinned_backend.checkpoint import parse_config
from pinned_backend.kvcache import BlockAllocator, CacheFull, PagedKVCache

CONFIG = parse_config(
    {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
    }
)


def test_cache_has_one_zeroed_k_and_v_tensor_per_layer_in_the_documented_layout() -> None:
    cache = PagedKVCache(CONFIG, num_blocks=5, block_size=4, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert len(cache.k) == len(cache.v) == 3
    for tensor in (*cache.k, *cache.v):
        assert tensor.shape == (5, 4, 2, 8)
        assert tensor.dtype == torch.bfloat16
        assert not tensor.any(), "a fresh cache must hold zeros, never garbage that could be NaN"


def test_write_puts_each_token_at_its_block_and_offset() -> None:
    cache = PagedKVCache(CONFIG, num_blocks=4, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    keys = torch.randn(2, 2, 8)
    values = torch.randn(2, 2, 8)
    cache.write(1, torch.tensor([3 * 4 + 1, 0 * 4 + 3]), keys, values)
    assert torch.equal(cache.k[1][3, 1], keys[0]) and torch.equal(cache.k[1][0, 3], keys[1])
    assert torch.equal(cache.v[1][3, 1], values[0]) and torch.equal(cache.v[1][0, 3], values[1])
    assert not cache.k[0].any() and not cache.k[2].any()


def test_blocks_for_budget_counts_keys_and_values_of_every_layer() -> None:
    per_block = 2 * 3 * 16 * (2 * 8) * 2  # k and v, layers, tokens, kv heads * head_dim, bf16 bytes
    assert PagedKVCache.blocks_for_budget(CONFIG, 10 * per_block + per_block - 1, 16, torch.bfloat16) == 10
    assert PagedKVCache.blocks_for_budget(CONFIG, 10 * per_block, 16, torch.float32) == 5


def test_a_budget_below_one_block_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.blocks_for_budget(CONFIG, 100, 16, torch.float32)


def test_allocator_hands_out_lowest_ids_first_and_reuses_freed_ones() -> None:
    allocator = BlockAllocator(6)
    assert allocator.allocate(2) == [0, 1]
    assert allocator.allocate(3) == [2, 3, 4]
    allocator.free([1, 3])
    assert allocator.free_blocks == 3
    assert allocator.allocate(2) == [1, 3]


def test_allocating_more_than_is_free_raises_cache_full_and_takes_nothing() -> None:
    allocator = BlockAllocator(3)
    allocator.allocate(2)
    with pytest.raises(CacheFull):
        allocator.allocate(2)
    assert allocator.free_blocks == 1


def test_freeing_a_block_twice_or_one_never_allocated_is_an_error() -> None:
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(1)
    allocator.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        allocator.free([2])
    assert allocator.free_blocks == 3
