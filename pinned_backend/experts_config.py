"""The sparse layers a mixture-of-experts family's config.json describes, read into a `MoeConfig`: Qwen3-MoE,
Mixtral, gpt-oss and DeepSeek-V3, with Hugging Face's defaults where a key is absent. families.py reads the rest of
each config; this module knows nothing of weights or of routing itself (routing.py, moe.py).
"""

from __future__ import annotations

from typing import Any

from pinned_backend.config_keys import CheckpointError, count, layer_set, optional, positive, require
from pinned_backend.model_config import MoeConfig


def deepseek_moe(raw: dict[str, Any], layers: int, where: str) -> MoeConfig:
    """DeepSeek-V3: from `first_k_dense_replace` on, sigmoid-scored experts chosen within the best groups, beside
    shared experts."""
    experts = require(raw, "n_routed_experts", int, where)
    first_dense = count(raw, "first_k_dense_replace", where)
    groups = optional(raw, "n_group", int, where, 1)
    chosen_groups = optional(raw, "topk_group", int, where, 1)
    if experts % groups or chosen_groups > groups or experts // groups < 2:
        raise CheckpointError(
            f"{where}: {experts} experts in n_group={groups} groups of at least two, topk_group={chosen_groups} "
            "of them chosen, is not a valid grouping"
        )
    return MoeConfig(
        layout="deepseek_v3",
        num_experts=experts,
        num_experts_per_tok=_top_k(require(raw, "num_experts_per_tok", int, where), experts, where),
        moe_intermediate_size=require(raw, "moe_intermediate_size", int, where),
        norm_topk_prob=optional(raw, "norm_topk_prob", bool, where, True),
        sparse_layers=frozenset(range(first_dense, layers)),
        scoring="sigmoid",
        n_group=groups,
        topk_group=chosen_groups,
        routed_scaling_factor=positive(raw, "routed_scaling_factor", where, 1.0),
        shared_intermediate_size=require(raw, "moe_intermediate_size", int, where)
        * count(raw, "n_shared_experts", where),
    )


def qwen3_moe(raw: dict[str, Any], layers: int, where: str) -> MoeConfig:
    """Qwen3-MoE's keys as Hugging Face's Qwen3MoeConfig reads them (its defaults where a key is absent)."""
    experts = require(raw, "num_experts", int, where)
    step = require(raw, "decoder_sparse_step", int, where) if "decoder_sparse_step" in raw else 1
    dense = layer_set(raw, "mlp_only_layers", layers, where)
    sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    return MoeConfig(
        layout="qwen3_moe",
        num_experts=experts,
        num_experts_per_tok=_top_k(require(raw, "num_experts_per_tok", int, where), experts, where),
        moe_intermediate_size=require(raw, "moe_intermediate_size", int, where),
        norm_topk_prob=optional(raw, "norm_topk_prob", bool, where, False),
        sparse_layers=sparse,
    )


def mixtral_moe(raw: dict[str, Any], layers: int, where: str) -> MoeConfig:
    """Mixtral's experts are every layer's MLP, their top-k always renormalised."""
    experts = require(raw, "num_local_experts", int, where)
    return MoeConfig(
        layout="mixtral",
        num_experts=experts,
        num_experts_per_tok=_top_k(require(raw, "num_experts_per_tok", int, where), experts, where),
        moe_intermediate_size=require(raw, "intermediate_size", int, where),
        norm_topk_prob=True,
        sparse_layers=frozenset(range(layers)),
    )


def _top_k(top_k: int, experts: int, where: str) -> int:
    if top_k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {top_k} is more than the {experts} experts")
    return top_k


def gpt_oss_moe(raw: dict[str, Any], size: int, layers: int, where: str) -> MoeConfig:
    """gpt-oss: every MLP is experts, a biased router whose top k logits are softmaxed, clamped SwiGLU with biases."""
    experts = require(raw, "num_local_experts", int, where)
    top_k = require(
        raw, "num_experts_per_tok" if "num_experts_per_tok" in raw else "experts_per_token", int, where
    )
    return MoeConfig(
        layout="gpt_oss",
        num_experts=experts,
        num_experts_per_tok=_top_k(top_k, experts, where),
        moe_intermediate_size=size,
        norm_topk_prob=False,
        sparse_layers=frozenset(range(layers)),
        scoring="topk_softmax",
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_alpha=optional(raw, "swiglu_alpha", float, where, 1.702),
        swiglu_limit=positive(raw, "swiglu_limit", where, 7.0),
    )
