"""`default` mode's attention for steps that prefill, on CUDA: torch's FlashAttention over the paged cache's keys.

A default server runs the fastest attention it has, and on CUDA that is FlashAttention; the Triton kernel beside
this module is written for a fixed reduction order and prefills 2-5x slower (bench/results/h200_attention.json).
FlashAttention cannot read a paged cache, so each layer first gathers every sequence's cache blocks (as many as the
block table is wide) into one tensor, then calls the variable-length kernel, each sequence reading its keys up to
its last query's position, with causal masking aligned to that last key: a sequence's queries are its last
positions, as the engine lays out every step, whether the step is its first chunk, a later chunk after a
prefix-cache hit, or a verify pass. Everything is computed on the device from tensors whose sizes the host knows,
so a step still runs without reading back from the device and can be captured as a CUDA graph.

It serves steps with more query tokens than sequences (some sequence prefills) whose gather stays within a bound of
their size: a decode step, or a short chunk or verify pass beside long contexts, would gather every sequence's
whole cache to read it once, which the paged kernel reads in place (as fast as FlashAttention when decoding).
Variants FlashAttention has here: sliding windows; soft-capped scores and sinks go to the paged kernel.
"""

from __future__ import annotations

import functools

import torch

_DTYPES = (torch.float16, torch.bfloat16)
# The most keys gathered per query token: past it (a short chunk or a verify pass beside sequences of long context,
# whose whole block tables would be copied at every layer) the paged kernel, which reads the cache in place, is the
# cheaper, and the gather's memory stays bounded by the step's own size.
_GATHERED_PER_QUERY = 16
_MAX_HEAD_DIM = 256


@functools.cache
def _flash_on(device: torch.device) -> bool:
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8 and torch.backends.cuda.flash_sdp_enabled()


def serves(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    *,
    sinks: torch.Tensor | None,
    softcap: float | None,
) -> bool:
    """Whether this step's attention goes to FlashAttention: a step that prefills, whose gathered keys are not many
    more than its queries, in a dtype and head size flash takes, without a variant it lacks."""
    gathered = block_tables.shape[0] * block_tables.shape[1] * block_size
    return (
        q.shape[0] > block_tables.shape[0]
        and gathered <= _GATHERED_PER_QUERY * q.shape[0]
        and sinks is None
        and softcap is None
        and q.dtype in _DTYPES
        and q.shape[-1] <= _MAX_HEAD_DIM
        and q.shape[-1] % 8 == 0
        and _flash_on(q.device)
    )


def flash_prefill(
    q: torch.Tensor,  # [T, Hq, D], each sequence's queries together, sequences in block-table order
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32
    query_pos: torch.Tensor,  # [T] int32
    scale: float,
    window: int | None,
) -> torch.Tensor:  # [T, Hq, Dv]
    n_seqs, width = block_tables.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    span = width * block_size  # keys each sequence may have, by the block table's width
    bounds = torch.arange(n_seqs + 1, dtype=query_seq.dtype, device=q.device)
    # Each sequence's queries are together, in block-table order: the first query of sequence s is the number of
    # queries before it, and its last query's position + 1 is how many keys it reads (a sequence without queries
    # reads a length it never uses).
    cum_q = torch.searchsorted(query_seq, bounds, out_int32=True)
    lengths = query_pos[cum_q[1:] - 1] + 1
    # Sequence s's keys start at s * span in the gathered tensors.
    cum_k = bounds.to(torch.int32) * span
    keys = k_cache[block_tables].view(n_seqs * span, n_kv_heads, k_cache.shape[3])
    values = v_cache[block_tables].view(n_seqs * span, n_kv_heads, v_cache.shape[3])
    windowed = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    return torch.ops.aten._flash_attention_forward(
        q, keys, values, cum_q, cum_k, q.shape[0], span, 0.0, True, False,
        scale=scale, seqused_k=lengths.to(torch.int32), **windowed,
    )[0]  # fmt: skip
