"""Specification of the paged KV cache and its block allocator."""

from __future__ import annotations

import pytest
import torch

from pinned_backend.checkpoint import parse_config
from pinned_backend.kvcache import (
    KV_CONTEXTS,
    KV_MEMORY_SHARE,
    ROOT_KEY,
    BlockAllocator,
    CacheFull,
    PagedKVCache,
    automatic_budget,
    block_key,
    block_keys,
)

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


SMOLLM2 = parse_config(
    {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
    }
)


def test_the_automatic_budget_holds_a_few_whole_contexts_within_a_share_of_the_memory_available() -> None:
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M in fp32: 45 KiB of keys and values a token
    plenty = automatic_budget(SMOLLM2, torch.float32, available_bytes=19 * 2**30)
    assert plenty == per_token * 8192 * KV_CONTEXTS, "room for whole contexts, not 1,456 tokens"
    assert KV_CONTEXTS >= 2
    scarce = automatic_budget(SMOLLM2, torch.float32, available_bytes=2 * 2**30)
    assert scarce == int(2 * 2**30 * KV_MEMORY_SHARE) < plenty
    assert automatic_budget(SMOLLM2, torch.bfloat16, available_bytes=19 * 2**30) == plenty // 2


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


def test_a_block_key_names_the_whole_prefix_up_to_the_blocks_end() -> None:
    keys = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(keys) == 2, "only full blocks have keys"
    assert keys == [block_key(ROOT_KEY, [1, 2, 3, 4]), block_key(keys[0], [5, 6, 7, 8])]
    assert block_keys([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != keys[1], "the same tokens after another prefix"
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == keys, "the same prefix, the same keys"
    assert block_key(ROOT_KEY, [1, 256]) != block_key(ROOT_KEY, [256, 1])


def test_a_published_block_is_found_by_its_key_and_shared_by_reference_count() -> None:
    allocator = BlockAllocator(4)
    keys = block_keys(list(range(8)), 4)
    first = allocator.allocate(2)
    assert allocator.publish(first[0], keys[0]) and allocator.publish(first[1], keys[1])
    assert allocator.lookup([*keys, b"absent"]) == first
    assert allocator.free_blocks == 2
    allocator.free(first)
    assert allocator.free_blocks == 2, "still held once, by the lookup"
    allocator.free(first)
    assert allocator.free_blocks == 4 and allocator.cached_blocks == 2, (
        "idle blocks stay cached and count as free"
    )
    assert allocator.lookup([b"absent", keys[1]]) == [], "a hit is a run of keys from the first"
    assert allocator.lookup(keys) == first and allocator.free_blocks == 2


def test_idle_cached_blocks_are_taken_only_when_no_free_block_is_left_least_recently_used_first() -> None:
    allocator = BlockAllocator(4)
    a, b = block_keys([1] * 8, 4), block_keys([2] * 8, 4)
    held_a, held_b = allocator.allocate(2), allocator.allocate(2)
    for block, key in [*zip(held_a, a, strict=True), *zip(held_b, b, strict=True)]:
        allocator.publish(block, key)
    allocator.free(held_a)
    allocator.free(held_b)
    allocator.free(allocator.lookup(a))  # a was used last: b's blocks are the older, b's tail the oldest
    assert allocator.allocate(1) == [held_b[1]]
    assert allocator.lookup(b) == [held_b[0]], "the head of b is still a hit"
    assert allocator.allocate(2) == [held_a[1], held_a[0]] and allocator.cached_blocks == 1
    with pytest.raises(CacheFull):
        allocator.allocate(1)


def test_a_key_names_one_block_and_a_block_one_key() -> None:
    allocator = BlockAllocator(3)
    key, other = block_keys([5] * 4, 4)[0], block_keys([6] * 4, 4)[0]
    one, two = allocator.allocate(2)
    assert allocator.publish(one, key)
    assert not allocator.publish(two, key), "computed twice side by side: the second copy stays private"
    assert not allocator.publish(one, other)
    allocator.free([one, two])
    assert allocator.free_blocks == 3 and allocator.cached_blocks == 1
    with pytest.raises(ValueError, match="nobody holds"):
        allocator.publish(two, other)
