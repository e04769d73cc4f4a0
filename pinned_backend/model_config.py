"""A decoder's shape and variant, as a checkpoint's config.json gives it: `ModelConfig` and its parts.

One frozen dataclass describes every family the backend serves: the common shape (sizes, heads, norms, rotary
embedding) and the variants families add, each a field whose default is what Llama does. Which family sets which
field is families.py's business (it reads config.json into this); which tensors a config implies is layout.py's;
what the forward pass does with each field is model.py's. This module only holds the description.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pinned_backend.rope import RopeScaling

Activation = Literal["silu", "gelu_tanh"]
ExpertActivation = Literal["silu", "clamped_swiglu"]
# Where a layer's norms sit: "pre" (Llama: before attention and before the MLP), "sandwich" (Gemma: those, and
# on each block's output too), "post" (OLMo 2: only on each block's output).
NormLayout = Literal["pre", "sandwich", "post"]
# How a router scores its experts: "softmax" (Qwen3-MoE, Mixtral: a softmax over all, the top k kept), "topk_softmax"
# (gpt-oss: the top k logits, then a softmax over those), "sigmoid" (DeepSeek-V3: sigmoid scores, chosen with a bias
# within the best groups).
Scoring = Literal["softmax", "topk_softmax", "sigmoid"]


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP layers of a mixture-of-experts model, in the checkpoint's naming `layout`."""

    layout: str  # "qwen3_moe", "mixtral", "gpt_oss" or "deepseek_v3": where the router and experts are stored
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to one
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts; the others are dense
    scoring: Scoring = "softmax"
    router_bias: bool = False  # gpt-oss: the router's linear map has a bias
    expert_bias: bool = False  # gpt-oss: each expert's gate/up and down have biases
    activation: ExpertActivation = "silu"
    # Clamped SwiGLU: (up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g), g = gate.clamp(max=limit).
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    n_group: int = 1  # sigmoid scoring: experts in groups, the best `topk_group` groups eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0  # DeepSeek-V3: a dense MLP beside the experts (0: none)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values live in the cache as one compressed latent per
    token (`kv_lora_rank` wide) and a rotated key shared by every head (`qk_rope_head_dim` wide)."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotated dimensions are stored as pairs (x0, x1), (x2, x3), ...
    mtp_layers: int = 0  # multi-token prediction layers after the last; loaded and ignored


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # the rotated head size; MLA: the rotated part of q and k
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    # An RMSNorm on q and k before the rotation: per head, or over the whole projection (`qk_norm_span`).
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    moe: MoeConfig | None = None
    # One divisor per rotary frequency [head_dim / 2], as GGUF files carry Llama 3.x scaling (`rope_freqs`).
    rope_freq_factors: tuple[float, ...] | None = None
    # Attention variants.
    o_bias: bool = False  # the output projection's bias (Llama with attention_bias, gpt-oss)
    qk_norm_span: Literal["head", "projection"] = "head"
    # A sliding layer's query sees this many keys: itself and the window - 1 before it.
    sliding_window: int | None = None
    sliding_layers: frozenset[int] = frozenset()
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own base (and no scaling)
    nope_layers: frozenset[int] = frozenset()  # SmolLM3: layers whose q and k are not rotated
    attn_scale: float | None = None  # the softmax's scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    sinks: bool = False  # gpt-oss: a learned logit per head that takes a share of every softmax
    # Ministral 3: q times 1 + beta * log(1 + floor(position / original context)).
    query_scale_beta: float | None = None
    mla: MlaConfig | None = None
    # Norms, residual, embedding and logits.
    norm_layout: NormLayout = "pre"
    norm_offset: bool = False  # Gemma: a norm multiplies by 1 + weight
    embed_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: each block's output is scaled before it is added
    logits_divisor: float = 1.0  # Granite: logits_scaling
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    # The dense MLP.
    activation: Activation = "silu"
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj as stored

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def cache_shape(self) -> tuple[int, int, int]:
        """What the KV cache holds per token and layer: (heads, key width, value width). MLA keeps one latent and
        one rotated key per token, and its values are the latent's first kv_lora_rank elements: value width 0."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.num_key_value_heads, self.head_dim, self.head_dim

    def window(self, layer: int) -> int | None:
        return self.sliding_window if layer in self.sliding_layers else None
