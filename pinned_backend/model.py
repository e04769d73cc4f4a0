"""A Llama/Qwen-family decoder over a paged KV cache, every reduction routed through a `Kernels` object.

Covers Llama 2/3.x (including `llama3` RoPE scaling), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k
RMSNorm), tied or untied embeddings, grouped-query attention and a SwiGLU MLP; in Qwen3-MoE and Mixtral, the
sparse layers' MLP is a mixture of experts (moe.py, routed as routing.py decides). Weights arrive under their
Hugging Face names (checkpoint.py, or gguf_checkpoint.py from a GGUF file) and are fused here: q/k/v into one
matrix, gate/up into another, so each layer issues four GEMMs. This module computes one step's logits; which tokens make up a step, the block
tables and sampling belong to the engine, and the reduction order of each op belongs to the kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pinned_backend.checkpoint import ModelConfig, RopeScaling, load_config, load_weights
from pinned_backend.gguf_checkpoint import is_gguf, open_gguf
from pinned_backend.kernels import Kernels

# Re-exported: the reference model in tiny.py and the tests import them from here.
from pinned_backend.kernels.unfused import apply_rope as apply_rope
from pinned_backend.kernels.unfused import silu as silu
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.moe import ExpertWeights, moe_mlp, take_experts
from pinned_backend.routing import DROPLESS, ExpertRouting

SERVING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a sparse layer
    down: torch.Tensor | None  # [hidden, intermediate]
    experts: ExpertWeights | None = None  # a sparse layer's router and experts


def matmul_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The (N, K) of each weight the forward pass multiplies by through the dense matmul, fused as this module fuses
    them: a mixture-of-experts model's router, and its dense MLP only where some layer has one (its experts go
    through the grouped expert matmul, whose tile no plan decides)."""
    c = config
    shapes = {"qkv": (c.q_size + 2 * c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size)}
    if c.moe is None or len(c.moe.sparse_layers) < c.num_hidden_layers:
        shapes["gate_up"] = (2 * c.intermediate_size, c.hidden_size)
        shapes["down"] = (c.hidden_size, c.intermediate_size)
    if c.moe is not None:
        shapes["router"] = (c.moe.num_experts, c.hidden_size)
    shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    return shapes


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SERVING_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SERVING_DTYPES)
        raise ValueError(f"cannot serve weights in {dtype}; choose one of {names}")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float32, computed as Hugging Face computes them."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        kernels: Kernels,
        device: torch.device,
        dtype: torch.dtype,
        *,
        routing: ExpertRouting = DROPLESS,
    ) -> None:
        """`weights`: every tensor `checkpoint.expected_shapes(config)` names; consumed (fused) here. `routing`:
        how a mixture-of-experts model's tokens find their experts (a dense model takes only the default)."""
        _check_dtype(dtype)
        if config.moe is None and routing != DROPLESS:
            raise ValueError(
                f"an expert capacity factor applies to mixture-of-experts models; this {config.model_type} is dense"
            )
        self.config = config
        self.routing = routing
        self.kernels = kernels
        self.device = device
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else take("lm_head.weight")
        self.layers = [self._take_layer(i, take) for i in range(config.num_hidden_layers)]
        # Rotary angles for every position, computed once: a row's cos/sin are then read, never recomputed in a
        # step whose shape could change how the vectorised cos/sin treats it. [max_positions, head_dim / 2]
        angles = (
            torch.arange(config.max_position_embeddings).float()[:, None] * rope_inv_freq(config)[None, :]
        )
        self.rope_cos = angles.cos().to(device)
        self.rope_sin = angles.sin().to(device)

    def _take_layer(self, i: int, take: Callable[[str], torch.Tensor]) -> _Layer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
        moe, experts, gate_up, down = self.config.moe, None, None, None
        if moe is not None and i in moe.sparse_layers:
            experts = take_experts(p, moe, take)
        else:
            gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]).contiguous()
            down = take(mlp + "down_proj.weight")
        return _Layer(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"]).contiguous(),
            qkv_bias=bias,
            q_norm=take(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=take(attn + "k_norm.weight") if self.config.qk_norm else None,
            o=take(attn + "o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=gate_up,
            down=down,
            experts=experts,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: Path,
        kernels: Kernels,
        device: torch.device,
        dtype: torch.dtype,
        *,
        routing: ExpertRouting = DROPLESS,
    ) -> Transformer:
        """Load a Hugging Face checkpoint folder or a GGUF file; a CheckpointError names any missing or malformed
        file."""
        _check_dtype(dtype)
        path = Path(path)
        if is_gguf(path):
            gguf = open_gguf(path)
            return cls(gguf.config, gguf.weights(dtype), kernels, device, dtype, routing=routing)
        config = load_config(path)
        return cls(config, load_weights(path, config, dtype), kernels, device, dtype, routing=routing)

    def forward(
        self,
        token_ids: torch.Tensor,  # [T] int64, this step's new tokens, sequences concatenated
        query_seq: torch.Tensor,  # [T] int32, row of block_tables per token
        query_pos: torch.Tensor,  # [T] int32, absolute position per token
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        cache: PagedKVCache,
        logits_rows: torch.Tensor,  # [R] int64, which of the T rows need logits
    ) -> torch.Tensor:  # [R, vocab] float32 logits
        h = self.hidden_states(token_ids, query_seq, query_pos, block_tables, cache, logits_rows)
        with torch.inference_mode():
            return self.kernels.matmul(h, self.lm_head).float()

    def hidden_states(
        self,
        token_ids: torch.Tensor,  # [T] int64, as forward's
        query_seq: torch.Tensor,  # [T] int32
        query_pos: torch.Tensor,  # [T] int32
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        cache: PagedKVCache,
        rows: torch.Tensor,  # [R] int64, which of the T rows to return
    ) -> torch.Tensor:  # [R, hidden] in the model's dtype: the final norm's output, what the LM head reads
        n_tokens = token_ids.shape[0]
        if query_seq.shape != (n_tokens,) or query_pos.shape != (n_tokens,):
            raise ValueError(
                f"token_ids, query_seq and query_pos must all be [T]; got {tuple(token_ids.shape)}, "
                f"{tuple(query_seq.shape)}, {tuple(query_pos.shape)}"
            )
        with torch.inference_mode():
            pos = query_pos.long()
            block_size = cache.block_size
            slots = block_tables[query_seq.long(), pos // block_size].long() * block_size + pos % block_size
            eps, last = self.config.rms_norm_eps, len(self.layers) - 1
            x = self.embed[token_ids]  # [T, hidden], the residual stream
            h = self.kernels.rms_norm(x, self.layers[0].input_norm, eps)  # what the next block reads
            for i, layer in enumerate(self.layers):
                attended = self._attention(i, layer, h, pos, slots, query_seq, query_pos, block_tables, cache)
                x, h = self.kernels.add_rms_norm(x, attended, layer.post_norm, eps)
                mlp_out = self._mlp(layer, h)
                if i < last:
                    x, h = self.kernels.add_rms_norm(x, mlp_out, self.layers[i + 1].input_norm, eps)
            # The final norm runs on the rows asked for alone; adding only those rows gives each of them the bits
            # that adding every row would.
            _, h = self.kernels.add_rms_norm(x[rows], mlp_out[rows], self.norm, eps)
            return h

    def _attention(
        self,
        index: int,
        layer: _Layer,
        h: torch.Tensor,  # [T, hidden]
        pos: torch.Tensor,  # [T] int64 position of each token
        slots: torch.Tensor,  # [T] cache slot of each token
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        block_tables: torch.Tensor,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        c = self.config
        qkv = self.kernels.matmul(h, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q = self.kernels.qkv_rope_cache(
            qkv, layer.q_norm, layer.k_norm, c.rms_norm_eps, self.rope_cos, self.rope_sin, pos, slots,
            cache.k[index], cache.v[index],
        )  # fmt: skip
        attended = self.kernels.attention(
            q, cache.k[index], cache.v[index], block_tables, query_seq, query_pos, 1.0 / math.sqrt(c.head_dim)
        )
        return self.kernels.matmul(attended.reshape(h.shape[0], c.q_size), layer.o)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.experts is not None and self.config.moe is not None:
            return moe_mlp(self.kernels, layer.experts, h, self.config.moe, self.routing)
        assert layer.gate_up is not None and layer.down is not None
        return self.kernels.matmul(self.kernels.silu_mul(self.kernels.matmul(h, layer.gate_up)), layer.down)
