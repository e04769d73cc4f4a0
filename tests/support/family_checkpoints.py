"""Tiny random checkpoints of every served model family, in Hugging Face's folder layout, for the families' tests.

Each config is the smallest that still has what makes its family different: two layers where the family alternates
layer kinds (one sliding, one global; one rotated, one NoPE), a sliding window of 8 tokens so that prompts of a few
dozen tokens run past it, rotary scalings whose context limits such prompts cross (Phi-3's LongRoPE, Ministral 3's
query scale), soft-caps small enough to bite on random weights, and for the mixtures of experts, experts enough to
route among. Written as the Hub writes them (config.json, model.safetensors, a character tokenizer), read by
transformers as its own, and by the backend's loader. The same seed writes the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.support.backend_checkpoint import _write_character_tokenizer, write_random_checkpoint

# What tests/test_invariance.py's random prompts draw from; the tokenizer's characters fit under it.
VOCAB = 96
WINDOW = 8
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
}
ALTERNATING = ["sliding_attention", "full_attention"]

FAMILIES: dict[str, dict[str, Any]] = {
    "mistral": {**BASE, "model_type": "mistral", "sliding_window": WINDOW},
    "ministral": {**BASE, "model_type": "ministral", "sliding_window": WINDOW, "layer_types": ALTERNATING},
    "ministral3": {
        **{k: v for k, v in BASE.items() if k != "rope_theta"},
        "model_type": "ministral3",
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
    "phi3": {
        **BASE,
        "model_type": "phi3",
        "sliding_window": 16,
        "original_max_position_embeddings": 32,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.7],
            "long_factor": [1.0, 2.0, 4.5, 9.0],
        },
    },
    "gemma2": {
        **BASE,
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0,
    },
    "gemma3_text": {
        **BASE,
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": WINDOW,
        "layer_types": ALTERNATING,
        "query_pre_attn_scalar": 16,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    "olmo2": {**BASE, "model_type": "olmo2"},
    "olmo3": {**BASE, "model_type": "olmo3", "sliding_window": WINDOW, "layer_types": ALTERNATING},
    "granite": {
        **BASE,
        "model_type": "granite",
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.25,
        "logits_scaling": 2.0,
    },
    "smollm3": {**BASE, "model_type": "smollm3", "no_rope_layers": [1, 0]},
    "gpt_oss": {
        **{k: v for k, v in BASE.items() if k != "rope_theta"},
        "model_type": "gpt_oss",
        "intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ALTERNATING,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
    },
    "deepseek_v3": {
        **{k: v for k, v in BASE.items() if k != "head_dim"},
        "model_type": "deepseek_v3",
        "num_key_value_heads": 4,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "rope_interleave": True,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64,
        },
    },
}


# The GPU's kernels take heads of 16 and more (a tensor-core tile's side).
GPU_HEADS: dict[str, Any] = {"hidden_size": 64, "head_dim": 16}
GPU_LATENT: dict[str, Any] = {
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
}


def gpu_config(family: str) -> dict[str, Any]:
    """`family`'s tiny config with heads the GPU's kernels take."""
    changes = {**GPU_HEADS, **GPU_LATENT, "v_head_dim": 16} if family == "deepseek_v3" else GPU_HEADS
    config = {**FAMILIES[family], **changes}
    if family == "phi3":  # one factor per frequency of the wider head
        factors = config["rope_scaling"]
        config["rope_scaling"] = {**factors, **{k: factors[k] * 2 for k in ("short_factor", "long_factor")}}
    return config


def write_family_checkpoint(folder: Path, family: str, seed: int = 0, *, gpu: bool = False) -> Path:
    """A random checkpoint of `family`'s tiny config (`gpu`: with heads the GPU's kernels take) with a character
    tokenizer (whose characters fit in VOCAB)."""
    write_random_checkpoint(folder, seed, config=gpu_config(family) if gpu else FAMILIES[family])
    _write_character_tokenizer(folder)
    if family == "deepseek_v3":
        _spread_correction(folder, seed)
    return folder


def _spread_correction(folder: Path, seed: int) -> None:
    # A correction bias of the router scores' own size, so that it changes which experts win.
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    generator = torch.Generator().manual_seed(seed + 1)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.1 * torch.randn(tensors[name].shape, generator=generator)
    save_file(tensors, str(path))


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())  # type: ignore[no-any-return]
