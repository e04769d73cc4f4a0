"""The tensors a config implies: every weight the forward pass needs, by its Hugging Face name, with its shape.

Names follow the checkpoints on the Hub, family by family: Phi-3 stores q/k/v and gate/up fused; Gemma has four
norms a layer and OLMo 2 two, after each block; Mixtral's experts sit under `block_sparse_moe` as w1/w3/w2, the other
mixture-of-experts families' under `mlp.experts`, one tensor per expert (DeepSeek-V3, Qwen3-MoE) or one stacked
tensor for all (gpt-oss, whose gate/up is stored [experts, hidden, 2 * intermediate], gate and up interleaved);
DeepSeek-V3's latent attention has its own projections. Shapes are the dequantised ones (stored_formats.py reads the
packed forms). This module knows nothing of files or of how the model arranges what it loads.
"""

from __future__ import annotations

from pinned_backend.model_config import ModelConfig, MoeConfig

Shapes = dict[str, tuple[int, ...]]


def expected_shapes(config: ModelConfig) -> Shapes:
    """Every tensor the forward pass needs, by Hugging Face name, with its shape."""
    c = config
    shapes: Shapes = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in norm_names(c):
            shapes[p + norm + ".weight"] = (c.hidden_size,)
        shapes.update(_latent_attention(p, c) if c.mla is not None else _attention(p, c))
        if c.moe is not None and i in c.moe.sparse_layers:
            shapes.update(expert_shapes(p, c.hidden_size, c.moe))
        else:
            shapes.update(_mlp(p + "mlp.", c.hidden_size, c.intermediate_size, c.fused_projections))
    return shapes


def norm_names(config: ModelConfig) -> tuple[str, ...]:
    """A layer's norms, in the order the layer applies them."""
    if config.norm_layout == "sandwich":
        return (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    if config.norm_layout == "post":
        return ("post_attention_layernorm", "post_feedforward_layernorm")
    return ("input_layernorm", "post_attention_layernorm")


def _attention(p: str, c: ModelConfig) -> Shapes:
    a = p + "self_attn."
    shapes: Shapes = {a + "o_proj.weight": (c.hidden_size, c.q_size)}
    if c.fused_projections:
        shapes[a + "qkv_proj.weight"] = (c.q_size + 2 * c.kv_size, c.hidden_size)
    else:
        for name, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
            shapes[a + f"{name}_proj.weight"] = (size, c.hidden_size)
            if c.attention_bias:
                shapes[a + f"{name}_proj.bias"] = (size,)
    if c.o_bias:
        shapes[a + "o_proj.bias"] = (c.hidden_size,)
    if c.qk_norm:
        q_width, k_width = (
            (c.q_size, c.kv_size) if c.qk_norm_span == "projection" else (c.head_dim, c.head_dim)
        )
        shapes[a + "q_norm.weight"] = (q_width,)
        shapes[a + "k_norm.weight"] = (k_width,)
    if c.sinks:
        shapes[a + "sinks"] = (c.num_attention_heads,)
    return shapes


def _latent_attention(p: str, c: ModelConfig) -> Shapes:
    assert c.mla is not None
    m, a, heads = c.mla, p + "self_attn.", c.num_attention_heads
    q_width = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    shapes: Shapes = {
        a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, c.hidden_size),
        a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
        a + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        a + "o_proj.weight": (c.hidden_size, heads * m.v_head_dim),
    }
    if m.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (q_width, c.hidden_size)
    else:
        shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, c.hidden_size)
        shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (q_width, m.q_lora_rank)
        if c.attention_bias:
            shapes[a + "q_a_proj.bias"] = (m.q_lora_rank,)
    if c.attention_bias:
        shapes[a + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
    if c.o_bias:
        shapes[a + "o_proj.bias"] = (c.hidden_size,)
    return shapes


def _mlp(prefix: str, hidden: int, size: int, fused: bool = False) -> Shapes:
    if fused:
        return {
            prefix + "gate_up_proj.weight": (2 * size, hidden),
            prefix + "down_proj.weight": (hidden, size),
        }
    return {
        prefix + "gate_proj.weight": (size, hidden),
        prefix + "up_proj.weight": (size, hidden),
        prefix + "down_proj.weight": (hidden, size),
    }


def expert_names(prefix: str, moe: MoeConfig) -> tuple[str, list[tuple[str, str, str]]]:
    """A sparse layer's router weight name and each expert's (gate, up, down) weight names, in expert order; for
    gpt-oss, whose experts are stacked, the three stacked names (gate/up fused) once."""
    if moe.layout == "gpt_oss":
        block = prefix + "mlp."
        return block + "router.weight", [(block + "experts.gate_up_proj", "", block + "experts.down_proj")]
    if moe.layout == "mixtral":
        block, gate, up, down = prefix + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        block, gate, up, down = prefix + "mlp.", "gate_proj", "up_proj", "down_proj"
    experts = [
        (
            f"{block}experts.{e}.{gate}.weight",
            f"{block}experts.{e}.{up}.weight",
            f"{block}experts.{e}.{down}.weight",
        )
        for e in range(moe.num_experts)
    ]
    return block + "gate.weight", experts


def expert_shapes(prefix: str, hidden: int, moe: MoeConfig) -> Shapes:
    router, experts = expert_names(prefix, moe)
    e, size = moe.num_experts, moe.moe_intermediate_size
    shapes: Shapes = {router: (e, hidden)}
    if moe.layout == "gpt_oss":
        gate_up, _, down = experts[0]
        shapes.update({gate_up: (e, hidden, 2 * size), down: (e, size, hidden)})
        shapes.update(
            {gate_up + "_bias": (e, 2 * size), down + "_bias": (e, hidden), router[:-6] + "bias": (e,)}
        )
        return shapes
    for gate, up, down in experts:
        shapes.update({gate: (size, hidden), up: (size, hidden), down: (hidden, size)})
    if moe.scoring == "sigmoid":
        shapes[router[:-6] + "e_score_correction_bias"] = (e,)
    if moe.shared_intermediate_size:
        shapes.update(_mlp(prefix + "mlp.shared_experts.", hidden, moe.shared_intermediate_size))
    return shapes
