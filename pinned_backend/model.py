"""A decoder over a paged KV cache, every reduction routed through a `Kernels` object.

One forward pass covers every family the backend serves (families.py reads their configs): Llama 2/3.x, Mistral and
Ministral, Qwen2/Qwen3, Phi-3, Gemma 2 and Gemma 3, OLMo 2 and OLMo 3, Granite, SmolLM3, and the mixture-of-experts
families Qwen3-MoE, Mixtral, gpt-oss and DeepSeek-V3. What varies is a field of `ModelConfig`, and each variant is a
function of a token's own row, so that none changes what batch invariance rests on:
- where a layer's norms sit (`norm_layout`: before each block, Gemma's around it, OLMo 2's after it), and Gemma's
  norms multiplying by 1 + weight (folded into the weight on load);
- attention: grouped-query heads, q/k norms per head or over the whole projection, a rotary table per layer kind
  (Gemma 3's local layers have their own base; SmolLM3's NoPE layers rotate by position 0, which is no rotation),
  sliding windows, soft-capped scores, attention sinks and Ministral 3's per-position query scale, all computed by the
  kernels' attention from the query's own position; DeepSeek-V3's latent attention (latent.py) over its compressed
  cache;
- the MLP: SwiGLU or GeGLU, or a mixture of experts (moe.py, routed as routing.py decides);
- scaled embeddings and residuals (Gemma, Granite), soft-capped or divided logits (Gemma 2, Granite).
Weights arrive under their Hugging Face names (checkpoint.py, or gguf_checkpoint.py from a GGUF file) and are fused
here: q/k/v into one matrix, gate/up into another, so that a layer issues four GEMMs. This module computes one step's
logits; which tokens make up a step, the block tables and sampling belong to the engine, and the reduction order of
each op belongs to the kernels.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from pinned_backend.checkpoint import ModelConfig, load_config, load_weights
from pinned_backend.gguf_checkpoint import is_gguf, open_gguf
from pinned_backend.kernels import Kernels

# Re-exported: the reference model in tiny.py and the tests import them from here.
from pinned_backend.kernels.unfused import apply_rope as apply_rope
from pinned_backend.kernels.unfused import silu as silu
from pinned_backend.kernels.unfused import softcap
from pinned_backend.kvcache import PagedKVCache
from pinned_backend.latent import LatentWeights, latent_attention, take_latent
from pinned_backend.layout import norm_names
from pinned_backend.moe import ExpertWeights, moe_mlp, shard_experts, take_experts
from pinned_backend.parallel.combine import Parallel
from pinned_backend.rope import inv_freq, rope_tables
from pinned_backend.routing import DROPLESS, ExpertRouting

SERVING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Take = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor | None  # [hidden] before attention; None in the post layout
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]; None with latent attention
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim], or [q_size] over the projection
    k_norm: torch.Tensor | None  # [head_dim], or [kv_size]
    o: torch.Tensor | None  # [hidden, q_size]
    post_norm: torch.Tensor | None  # [hidden] before the MLP; None in the post layout
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a sparse layer
    down: torch.Tensor | None  # [hidden, intermediate]
    experts: ExpertWeights | None = None  # a sparse layer's router and experts
    o_bias: torch.Tensor | None = None  # [hidden]
    sinks: torch.Tensor | None = None  # [heads] float32
    attn_out_norm: torch.Tensor | None = None  # [hidden] on the attention's output (sandwich, post)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on the MLP's output (sandwich, post)
    latent: LatentWeights | None = None
    rope: str = "global"  # the rotary table: "global", "local" (Gemma 3's sliding layers) or "none" (NoPE)
    # Under tensor parallelism, o and down as the row-parallel sum takes them (Parallel.split_weight); o and down
    # are then None.
    o_parts: tuple[torch.Tensor, ...] = ()
    down_parts: tuple[torch.Tensor, ...] = ()


def matmul_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """The (N, K) of each weight the forward pass multiplies by through the dense matmul, fused as this module fuses
    them: a mixture-of-experts model's router (and shared experts), and its dense MLP only where some layer has one
    (its experts go through the grouped expert matmul, whose tile no plan decides)."""
    c = config
    shapes: dict[str, tuple[int, int]] = {}
    if c.mla is not None:
        m, heads = c.mla, c.num_attention_heads
        latent = m.kv_lora_rank + m.qk_rope_head_dim
        shapes["latent_down"] = ((m.q_lora_rank or 0) + latent, c.hidden_size)
        q_width = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        shapes["q_up"] = (q_width, m.q_lora_rank or c.hidden_size)
        shapes["o_proj"] = (c.hidden_size, heads * m.v_head_dim)
    else:
        shapes["qkv"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
        shapes["o_proj"] = (c.hidden_size, c.q_size)
    if c.moe is None or len(c.moe.sparse_layers) < c.num_hidden_layers:
        shapes["gate_up"] = (2 * c.intermediate_size, c.hidden_size)
        shapes["down"] = (c.hidden_size, c.intermediate_size)
    if c.moe is not None:
        shapes["router"] = (c.moe.num_experts, c.hidden_size)
        if c.moe.shared_intermediate_size:
            shapes["shared_gate_up"] = (2 * c.moe.shared_intermediate_size, c.hidden_size)
            shapes["shared_down"] = (c.hidden_size, c.moe.shared_intermediate_size)
    shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    return shapes


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SERVING_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SERVING_DTYPES)
        raise ValueError(f"cannot serve weights in {dtype}; choose one of {names}")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim / 2] in float32 of the model's global layers, computed as Hugging Face
    computes them."""
    freqs = inv_freq(config.rope_theta, config.rope_scaling, config.head_dim)
    if config.rope_freq_factors is not None:
        freqs = freqs / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return freqs


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
        parallel: Parallel | None = None,
    ) -> None:
        """`weights`: every tensor `checkpoint.expected_shapes(config)` names; consumed (fused) here. `routing`:
        how a mixture-of-experts model's tokens find their experts (a dense model takes only the default).
        `parallel`: this rank's place in a tensor-parallel group; `config` and `weights` are then the rank's shard
        (parallel/shards.py), and the row-parallel products, the embedding and the logits cross ranks."""
        _check_dtype(dtype)
        if config.moe is None and routing != DROPLESS:
            raise ValueError(
                f"an expert capacity factor applies to mixture-of-experts models; this {config.model_type} is dense"
            )
        if config.moe is not None and config.moe.scoring != "softmax" and routing != DROPLESS:
            raise ValueError(
                f"an expert capacity factor applies to softmax routers; this {config.model_type} routes by "
                f"{config.moe.scoring}"
            )
        self.config = config
        self.routing = routing
        self.parallel = parallel
        self.kernels = kernels
        self.device = device
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = self._norm(take("model.norm.weight"))
        # Tied: the embedding is gathered from, so the LM head is a copy of it where `prepare` repacks it.
        self.lm_head = kernels.prepare(self.embed if config.tie_word_embeddings else take("lm_head.weight"))
        self.layers = [self._prepared(self._take_layer(i, take)) for i in range(config.num_hidden_layers)]
        # Rotary cos/sin for every position, computed once: a row's cos/sin are then read, never recomputed in a
        # step whose shape could change how the vectorised cos/sin treats it. [max_positions, head_dim / 2]
        self.rope = self._rope_tables()
        self.rope_cos, self.rope_sin = self.rope["global"]
        self.scale = config.attn_scale if config.attn_scale is not None else 1.0 / math.sqrt(config.head_dim)
        self.embed_scale = torch.tensor(config.embed_scale, dtype=torch.float32).to(
            device=device, dtype=dtype
        )
        self.query_scales = self._query_scales()

    def _rope_tables(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        c, positions = self.config, self.config.max_position_embeddings
        tables = {
            "global": rope_tables(c.rope_theta, c.rope_scaling, c.head_dim, positions, c.rope_freq_factors)
        }
        if c.local_rope_theta is not None:
            tables["local"] = rope_tables(c.local_rope_theta, None, c.head_dim, positions)
        # NoPE layers read row 0 of a table of one row: cos 1, sin 0, no rotation.
        tables["none"] = (torch.ones(1, c.head_dim // 2), torch.zeros(1, c.head_dim // 2))
        return {name: (cos.to(self.device), sin.to(self.device)) for name, (cos, sin) in tables.items()}

    def _query_scales(self) -> torch.Tensor | None:
        # Ministral 3: [max_positions] float32, 1 + beta * log(1 + floor(position / original context)).
        c = self.config
        if c.query_scale_beta is None or c.rope_scaling is None:
            return None
        floors = torch.floor(
            torch.arange(c.max_position_embeddings) / c.rope_scaling.original_max_position_embeddings
        )
        return (1 + c.query_scale_beta * torch.log(1 + floors)).to(self.device)

    def _norm(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        """A norm's weight as the kernels take it: Gemma's 1 + weight folded in, once."""
        if weight is None or not self.config.norm_offset:
            return weight
        return (weight.float() + 1).to(weight.dtype)

    def _take_layer(self, i: int, take: Take) -> _Layer:
        c = self.config
        p = f"model.layers.{i}."
        norms = dict(
            zip(norm_names(c), (self._norm(take(p + n + ".weight")) for n in norm_names(c)), strict=True)
        )
        pre_mlp = "pre_feedforward_layernorm" if c.norm_layout == "sandwich" else "post_attention_layernorm"
        attn_out = "post_attention_layernorm" if c.norm_layout != "pre" else ""
        moe, experts, gate_up, down = c.moe, None, None, None
        if moe is not None and i in moe.sparse_layers:
            experts = take_experts(p, moe, take)
            if self.parallel is not None:
                experts = shard_experts(experts, self.parallel.experts)
        elif c.fused_projections:
            gate_up, down = take(p + "mlp.gate_up_proj.weight"), take(p + "mlp.down_proj.weight")
        else:
            gate_up = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            ).contiguous()
            down = take(p + "mlp.down_proj.weight")
        rope = "none" if i in c.nope_layers else "local" if c.window(i) and c.local_rope_theta else "global"
        mlp = {
            "post_norm": norms.get(pre_mlp) if c.norm_layout != "post" else None,
            "gate_up": gate_up,
            "down": down,
            "experts": experts,
            "attn_out_norm": norms.get(attn_out),
            "mlp_out_norm": norms.get("post_feedforward_layernorm"),
            "rope": rope,
        }
        if c.mla is not None:
            latent = take_latent(p, c, take)
            return _Layer(norms.get("input_layernorm"), None, None, None, None, None, latent=latent, **mlp)
        attn = p + "self_attn."
        if c.fused_projections:
            qkv = take(attn + "qkv_proj.weight")
        else:
            qkv = torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"]).contiguous()
        layer = _Layer(
            input_norm=norms.get("input_layernorm"),
            qkv=qkv,
            qkv_bias=torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"]) if c.attention_bias else None,
            q_norm=self._norm(take(attn + "q_norm.weight")) if c.qk_norm else None,
            k_norm=self._norm(take(attn + "k_norm.weight")) if c.qk_norm else None,
            o=take(attn + "o_proj.weight"),
            o_bias=take(attn + "o_proj.bias") if c.o_bias else None,
            sinks=take(attn + "sinks").float() if c.sinks else None,
            **mlp,
        )
        if self.parallel is None:
            return layer
        assert layer.o is not None
        # A sparse layer has no down projection: its experts are the rank's own (moe.shard_experts).
        down = () if layer.down is None else self.parallel.split_weight("down", layer.down)
        return dataclasses.replace(
            layer, o=None, down=None, o_parts=self.parallel.split_weight("o", layer.o), down_parts=down
        )

    def _prepared(self, layer: _Layer) -> _Layer:
        """The layer with the weights that only the dense matmul reads as the kernels prepare them."""
        prepare = self.kernels.prepare

        def one(w: torch.Tensor | None) -> torch.Tensor | None:
            return None if w is None else prepare(w)

        return dataclasses.replace(
            layer,
            qkv=one(layer.qkv),
            o=one(layer.o),
            gate_up=one(layer.gate_up),
            down=one(layer.down),
            o_parts=tuple(prepare(w) for w in layer.o_parts),
            down_parts=tuple(prepare(w) for w in layer.down_parts),
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
            if self.parallel is None:
                logits = self.kernels.matmul(h, self.lm_head).float()
            else:
                logits = self.parallel.logits(self.kernels, h, self.lm_head).float()
            if self.config.logits_divisor != 1.0:
                logits = logits / self.config.logits_divisor
            if self.config.final_softcap is not None:
                logits = softcap(logits, self.config.final_softcap)
            return logits

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
            step = _Step(pos, slots, query_seq, query_pos, block_tables)
            # [T, hidden], the residual stream
            x = self.embed[token_ids] if self.parallel is None else self.parallel.embed(self.embed, token_ids)
            if self.config.embed_scale != 1.0:
                x = x * self.embed_scale
            pending: torch.Tensor | None = None  # the last block's output, not yet added to x
            for i, layer in enumerate(self.layers):
                x, h = self._add_norm(x, pending, layer.input_norm)
                attended = self._block_out(self._attention(i, layer, h, step, cache), layer.attn_out_norm)
                x, h = self._add_norm(x, attended, layer.post_norm)
                pending = self._block_out(self._mlp(layer, h), layer.mlp_out_norm)
            assert pending is not None
            # The final norm runs on the rows asked for alone; adding only those rows gives each of them the bits
            # that adding every row would.
            _, h = self._add_norm(x[rows], pending[rows], self.norm)
            return h

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual and what the next block reads (the residual itself without a norm)."""
        eps = self.config.rms_norm_eps
        if delta is None:
            return x, x if weight is None else self.kernels.rms_norm(x, weight, eps)
        if weight is None:
            summed = x + delta
            return summed, summed
        return self.kernels.add_rms_norm(x, delta, weight, eps)

    def _block_out(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        if norm is not None:
            out = self.kernels.rms_norm(out, norm, self.config.rms_norm_eps)
        if self.config.residual_scale != 1.0:
            out = out * self.config.residual_scale
        return out

    def _attention(
        self, index: int, layer: _Layer, h: torch.Tensor, step: _Step, cache: PagedKVCache
    ) -> torch.Tensor:
        c, k_cache, v_cache = self.config, cache.k[index], cache.v[index]
        rope = self.rope[layer.rope]
        if layer.latent is not None:
            steps = (step.query_seq, step.query_pos, step.block_tables)
            return latent_attention(
                self.kernels, layer.latent, c, h, rope, step.pos, step.slots, k_cache, steps, self.scale
            )
        assert layer.qkv is not None
        if layer.qkv.shape[0] == 0:  # a rank past the model's KV heads: its share of the sum is nothing
            return self._row_parallel("o", h.new_zeros(h.shape[0], 0), layer.o, layer.o_parts, layer.o_bias)
        qkv = self.kernels.matmul(h, layer.qkv)
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        head_norms = (layer.q_norm, layer.k_norm) if c.qk_norm_span == "head" else (None, None)
        if c.qk_norm_span == "projection":
            qkv = self._normalise_projections(qkv, layer)
        positions = step.pos if layer.rope != "none" else torch.zeros_like(step.pos)
        q = self.kernels.qkv_rope_cache(
            qkv, *head_norms, c.rms_norm_eps, *rope, positions, step.slots, k_cache, v_cache
        )
        if self.query_scales is not None:
            q = q * self.query_scales[step.pos][:, None, None].to(q.dtype)
        attended = self.kernels.attention(
            q, k_cache, v_cache, step.block_tables, step.query_seq, step.query_pos, self.scale,
            window=c.window(index), sinks=layer.sinks, softcap=c.attn_softcap,
        )  # fmt: skip
        flat = attended.reshape(h.shape[0], c.q_size)
        return self._row_parallel("o", flat, layer.o, layer.o_parts, layer.o_bias)

    def _row_parallel(
        self,
        which: Literal["o", "down"],
        x: torch.Tensor,
        weight: torch.Tensor | None,
        parts: tuple[torch.Tensor, ...],
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x @ a row-parallel weight (o or down): one matmul in one process, a sum over ranks under `parallel`."""
        if self.parallel is None:
            assert weight is not None
            out = self.kernels.matmul(x, weight)
        else:
            out = self.parallel.row(self.kernels, which, x, parts)
        return out if bias is None else out + bias

    def _normalise_projections(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        # OLMo 2: q and k each normalised over the whole projection, before they are split into heads.
        assert layer.q_norm is not None and layer.k_norm is not None
        c, eps = self.config, self.config.rms_norm_eps
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q, k = self.kernels.rms_norm(q, layer.q_norm, eps), self.kernels.rms_norm(k, layer.k_norm, eps)
        return torch.cat([q, k, v], dim=-1)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        if layer.experts is not None and self.config.moe is not None:
            return moe_mlp(self.kernels, layer.experts, h, self.config.moe, self.routing, self.parallel)
        assert layer.gate_up is not None
        gated = self.kernels.gelu_mul if self.config.activation == "gelu_tanh" else self.kernels.silu_mul
        return self._row_parallel(
            "down", gated(self.kernels.matmul(h, layer.gate_up)), layer.down, layer.down_parts
        )


@dataclass(frozen=True)
class _Step:
    """What every layer of one step reads besides its input."""

    pos: torch.Tensor  # [T] int64 position of each token
    slots: torch.Tensor  # [T] int64 cache slot of each token
    query_seq: torch.Tensor  # [T] int32
    query_pos: torch.Tensor  # [T] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
