"""Multi-head latent attention (DeepSeek-V2/V3), computed over its compressed cache.

A token's keys and values are never stored per head: the cache holds, per token and layer, the normalised latent
`c` (kv_lora_rank wide) and one rotated key `k_rot` shared by every head (qk_rope_head_dim wide), side by side in one
row; a prefix-cache block holds those rows as an ordinary block holds keys and values. A head's key is
`W_UK[h] c ++ k_rot` and its value `W_UV[h] c`, so its score and output can be taken in the latent space instead:
q_nope . (W_UK[h] c) = (W_UK[h]^T q_nope) . c, and sum_i p_i W_UV[h] c_i = W_UV[h] (sum_i p_i c_i). Each head's query
is mapped into the latent (`head_matmul`), attends over the cache rows as one key-and-value head
(`latent_attention`: the value is a row's latent part), and its output is mapped back out (`head_matmul` again). That
is Hugging Face's function with the products associated otherwise: the logits agree to float32 tolerance, not to the
bit. Every reduction goes through the kernels, so its order per row is theirs; the rotation and the cache write are
elementwise. The rotated dimensions, stored interleaved in the checkpoint (`rope_interleave`), are put in halves by
permuting the weight rows that produce them, so the rotation is the usual one. This module knows nothing of the layer
around it (model.py) or of how the cache's blocks are allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pinned_backend.kernels import Kernels
from pinned_backend.kernels.unfused import apply_rope
from pinned_backend.model_config import ModelConfig


@dataclass(frozen=True)
class LatentWeights:
    # [q_lora_rank + kv_lora_rank + rope, hidden]: q_a_proj and kv_a_proj fused (or kv_a alone).
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [q_lora_rank]
    q_up: torch.Tensor  # [heads * (nope + rope), q_lora_rank or hidden]
    kv_norm: torch.Tensor  # [kv_lora_rank]
    k_absorb: torch.Tensor  # [heads, kv_lora_rank, nope]: a head's q_nope into the latent (W_UK transposed)
    v_absorb: torch.Tensor  # [heads, v_head_dim, kv_lora_rank]: a head's latent output out (W_UV)
    o: torch.Tensor  # [hidden, heads * v_head_dim]
    o_bias: torch.Tensor | None


def take_latent(prefix: str, config: ModelConfig, take: Callable[[str], torch.Tensor]) -> LatentWeights:
    """Layer `prefix`'s latent attention weights, fused, split by head and with the rotated rows in halves."""
    assert config.mla is not None
    m, a, heads = config.mla, prefix + "self_attn.", config.num_attention_heads
    rope_rows = _halves(m.qk_rope_head_dim) if m.rope_interleave else torch.arange(m.qk_rope_head_dim)
    kv_rows = torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + rope_rows])
    head_rows = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + rope_rows])
    q_rows = (torch.arange(heads)[:, None] * head_rows.numel() + head_rows[None, :]).reshape(-1)
    kv_a = take(a + "kv_a_proj_with_mqa.weight")[kv_rows]
    kv_a_bias = take(a + "kv_a_proj_with_mqa.bias")[kv_rows] if config.attention_bias else None
    if m.q_lora_rank is None:
        down, down_bias, q_norm = kv_a, kv_a_bias, None
        q_up = take(a + "q_proj.weight")[q_rows]
    else:
        down = torch.cat([take(a + "q_a_proj.weight"), kv_a])
        down_bias = torch.cat([take(a + "q_a_proj.bias"), kv_a_bias]) if kv_a_bias is not None else None
        q_norm, q_up = take(a + "q_a_layernorm.weight"), take(a + "q_b_proj.weight")[q_rows]
    kv_b = take(a + "kv_b_proj.weight").view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return LatentWeights(
        down=down.contiguous(),
        down_bias=down_bias,
        q_norm=q_norm,
        q_up=q_up.contiguous(),
        kv_norm=take(a + "kv_a_layernorm.weight"),
        k_absorb=kv_b[:, : m.qk_nope_head_dim].transpose(1, 2).contiguous(),
        v_absorb=kv_b[:, m.qk_nope_head_dim :].contiguous(),
        o=take(a + "o_proj.weight"),
        o_bias=take(a + "o_proj.bias") if config.o_bias else None,
    )


def _halves(dim: int) -> torch.Tensor:
    # Pairs (x0, x1), (x2, x3), ... rotated together become (x0, x2, ...), (x1, x3, ...), rotated as halves.
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def latent_attention(
    kernels: Kernels,
    w: LatentWeights,
    config: ModelConfig,
    h: torch.Tensor,  # [T, hidden]
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [max_positions, rope / 2]
    pos: torch.Tensor,  # [T] int64
    slots: torch.Tensor,  # [T] int64 cache slot of each token
    cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank + rope]
    steps: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # query_seq, query_pos, block_tables
    scale: float,
) -> torch.Tensor:  # [T, hidden]
    assert config.mla is not None
    m, n, heads, eps = config.mla, h.shape[0], config.num_attention_heads, config.rms_norm_eps
    down = kernels.matmul(h, w.down)
    if w.down_bias is not None:
        down = down + w.down_bias
    latent_start = 0
    if w.q_norm is not None and m.q_lora_rank is not None:
        q = kernels.matmul(kernels.rms_norm(down[:, : m.q_lora_rank], w.q_norm, eps), w.q_up)
        latent_start = m.q_lora_rank
    else:
        q = kernels.matmul(h, w.q_up)
    c = kernels.rms_norm(down[:, latent_start : latent_start + m.kv_lora_rank], w.kv_norm, eps)
    k_rot = down[:, latent_start + m.kv_lora_rank :].reshape(n, 1, m.qk_rope_head_dim)
    q = q.view(n, heads, m.qk_nope_head_dim + m.qk_rope_head_dim)
    cos, sin = rope[0][pos][:, None, :], rope[1][pos][:, None, :]
    q_rot, k_rot = apply_rope(q[..., m.qk_nope_head_dim :], cos, sin), apply_rope(k_rot, cos, sin)
    cache.view(-1, cache.shape[-1])[slots] = torch.cat([c, k_rot[:, 0]], dim=-1).to(cache.dtype)
    q_latent = kernels.head_matmul(q[..., : m.qk_nope_head_dim], w.k_absorb)  # [T, H, kv_lora_rank]
    query = torch.cat([q_latent, q_rot], dim=-1)
    attended = kernels.latent_attention(query, cache, steps[2], steps[0], steps[1], scale, m.kv_lora_rank)
    out = kernels.head_matmul(attended, w.v_absorb).reshape(n, heads * m.v_head_dim)  # [T, H * v_head_dim]
    out = kernels.matmul(out, w.o)
    return out if w.o_bias is None else out + w.o_bias
