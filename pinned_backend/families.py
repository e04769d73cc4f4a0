"""Reading config.json into a `ModelConfig`, family by family.

Every family shares the common keys (sizes, heads, norm epsilon, rotary embedding, context); each then sets the
variants it adds, reading its own keys with Hugging Face's defaults where a key is absent, so that a config means
here what it means to transformers. A key that asks for something the backend does not compute (a bias it does not
load, an activation it does not have, a kind of attention layer it does not know) is refused by name, never ignored.
Where transformers names a family differently from the checkpoints on the Hub, its own name is the one served
(`gemma3_text`). A mixture of experts' keys are read in experts_config.py. This module knows nothing of weight
files (checkpoint.py, layout.py) or of the forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pinned_backend.config_keys import CheckpointError, count, flags, optional, positive, require
from pinned_backend.experts_config import deepseek_moe, gpt_oss_moe, mixtral_moe, qwen3_moe
from pinned_backend.model_config import MlaConfig, ModelConfig
from pinned_backend.rope import check_scaling, parse_rope, yarn_mscale

CONFIG_FILE = "config.json"
Extras = dict[str, Any]
_LAYER_KINDS = ("full_attention", "sliding_attention")
_GELU_TANH = ("gelu_pytorch_tanh",)


def parse_config(raw: Any, where: str = CONFIG_FILE) -> ModelConfig:
    """Validate a parsed config.json object; `where` names the file in error messages."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object at the top level")
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("mlp_bias") is True:
        raise CheckpointError(f"{where}: mlp_bias=True is not supported")
    common = _common(raw, where)
    return ModelConfig(model_type=model_type, **{**common, **FAMILIES[model_type](raw, common, where)})


def _common(raw: dict[str, Any], where: str) -> Extras:
    hidden = require(raw, "hidden_size", int, where)
    heads = require(raw, "num_attention_heads", int, where)
    kv_heads = optional(raw, "num_key_value_heads", int, where, heads)
    if raw.get("head_dim") is not None:
        head_dim = require(raw, "head_dim", int, where)
    elif hidden % heads == 0:
        head_dim = hidden // heads
    else:
        raise CheckpointError(
            f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}"
        )
    if heads % kv_heads != 0:
        raise CheckpointError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    theta, scaling = parse_rope(raw, where, "full_attention")
    return {
        "vocab_size": require(raw, "vocab_size", int, where),
        "hidden_size": hidden,
        "intermediate_size": require(raw, "intermediate_size", int, where),
        "num_hidden_layers": require(raw, "num_hidden_layers", int, where),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": require(raw, "rms_norm_eps", float, where),
        "rope_theta": theta,
        "max_position_embeddings": require(raw, "max_position_embeddings", int, where),
        "tie_word_embeddings": optional(raw, "tie_word_embeddings", bool, where, False),
        "attention_bias": optional(raw, "attention_bias", bool, where, False),
        "qk_norm": False,
        "rope_scaling": scaling,
    }


def _finish(raw: dict[str, Any], common: Extras, where: str, extras: Extras) -> Extras:
    """The checks every family's result passes: the rotated head is even, a LongRoPE recipe fits it, the
    activation is the one the family computes."""
    head_dim = extras.get("head_dim", common["head_dim"])
    if head_dim % 2 != 0:
        raise CheckpointError(f"{where}: head_dim {head_dim} must be even for rotary embeddings")
    check_scaling(common["rope_scaling"], head_dim, where)
    wanted = _GELU_TANH if extras.get("activation") == "gelu_tanh" else ("silu",)
    act = raw.get("hidden_activation") or raw.get("hidden_act") or wanted[0]
    if act not in wanted:
        raise CheckpointError(f"{where}: hidden_act {act!r} is not supported; only {wanted[0]!r} is")
    factor = raw.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise CheckpointError(f"{where}: partial_rotary_factor={factor!r} is not supported; only 1.0 is")
    return extras


def _windows(
    raw: dict[str, Any], layers: int, where: str, default: Callable[[int], bool], window: int | None
) -> Extras:
    """Which layers attend through a sliding window: the config's `layer_types` where it has them, else the family's
    rule `default(layer)`; none where `window` is None."""
    kinds = raw.get("layer_types")
    if kinds is not None:
        if not isinstance(kinds, list) or len(kinds) != layers or any(k not in _LAYER_KINDS for k in kinds):
            raise CheckpointError(
                f"{where}: 'layer_types' must list {layers} of {', '.join(map(repr, _LAYER_KINDS))}"
            )
        sliding = frozenset(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
    else:
        sliding = frozenset(i for i in range(layers) if default(i))
    if window is None or not sliding:
        return {}
    return {"sliding_window": window, "sliding_layers": sliding}


def _window(raw: dict[str, Any], where: str, default: int | None = None) -> int | None:
    return optional(raw, "sliding_window", int, where, default)


def _llama(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    # Llama's attention_bias covers the output projection too.
    return _finish(raw, common, where, {"o_bias": common["attention_bias"]})


def _qwen(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """Qwen2 (q/k/v biases always), Qwen3 and Qwen3-MoE (per-head q/k norms): sliding layers from
    `max_window_layers` on when `use_sliding_window` says so."""
    model_type, layers = raw["model_type"], common["num_hidden_layers"]
    first = count(raw, "max_window_layers", where) if "max_window_layers" in raw else 28
    window = _window(raw, where) if raw.get("use_sliding_window") is True else None
    extras = {
        **_windows(raw, layers, where, lambda i: i >= first, window),
        "attention_bias": model_type == "qwen2" or common["attention_bias"],
        "o_bias": model_type != "qwen2" and common["attention_bias"],
        "qk_norm": model_type != "qwen2",
        "moe": qwen3_moe(raw, layers, where) if model_type == "qwen3_moe" else None,
    }
    return _finish(raw, common, where, extras)


def _every_layer_windowed(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """Mistral, Mixtral, Ministral, Phi-3: every layer sees `sliding_window` keys when it is set (Ministral may say
    which layers in `layer_types`)."""
    model_type, layers = raw["model_type"], common["num_hidden_layers"]
    window = _window(raw, where)
    # Their projections never have biases, whatever attention_bias says.
    extras: Extras = {**_windows(raw, layers, where, lambda _: True, window), "attention_bias": False}
    if model_type == "mixtral":
        extras["moe"] = mixtral_moe(raw, layers, where)
    if model_type == "phi3":
        extras["fused_projections"] = True
    return _finish(raw, common, where, extras)


def _ministral3(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    extras = _windows(raw, common["num_hidden_layers"], where, lambda _: True, _window(raw, where))
    extras["attention_bias"] = False
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta") if isinstance(params, dict) else None
    if beta is not None:
        sub = f"{where} rope_parameters"
        extras["query_scale_beta"] = require(params, "llama_4_scaling_beta", float, sub)
        require(params, "original_max_position_embeddings", int, sub)
    return _finish(raw, common, where, extras)


def _gemma(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """Gemma 2 and Gemma 3 (text): norms around each block's input and output, each multiplying by 1 + weight;
    GeGLU; embeddings scaled by sqrt(hidden); local (sliding) and global layers; scores scaled by
    `query_pre_attn_scalar`; soft-capped scores and logits where set. Gemma 3 adds per-head q/k norms and a rotary
    base of its own for the local layers."""
    gemma3 = raw["model_type"] == "gemma3_text"
    layers, hidden = common["num_hidden_layers"], common["hidden_size"]
    if raw.get("use_bidirectional_attention") is True:
        raise CheckpointError(f"{where}: use_bidirectional_attention=True is not supported")
    pattern = optional(raw, "sliding_window_pattern", int, where, 6) if gemma3 else 2
    extras = {
        **_windows(raw, layers, where, lambda i: bool((i + 1) % pattern), _window(raw, where, 4096)),
        "norm_layout": "sandwich",
        "norm_offset": True,
        "activation": "gelu_tanh",
        "embed_scale": hidden**0.5,
        "attn_scale": optional(raw, "query_pre_attn_scalar", float, where, 256.0) ** -0.5,
        "attn_softcap": positive(raw, "attn_logit_softcapping", where, None if gemma3 else 50.0),
        "final_softcap": positive(raw, "final_logit_softcapping", where, None if gemma3 else 30.0),
        "tie_word_embeddings": optional(raw, "tie_word_embeddings", bool, where, True),
        "qk_norm": gemma3,
        "head_dim": optional(raw, "head_dim", int, where, 256),
        "o_bias": common["attention_bias"],
    }
    if gemma3:
        extras["local_rope_theta"] = _local_theta(
            raw, where, optional(raw, "rope_local_base_freq", float, where, 10000.0)
        )
        if "rope_theta" not in raw and not raw.get("rope_parameters"):
            extras["rope_theta"] = 1_000_000.0
    return _finish(raw, common, where, extras)


def _local_theta(raw: dict[str, Any], where: str, default: float) -> float:
    """The rotary base of the sliding layers of a family whose two kinds of layer rotate differently (Gemma 3,
    OLMo 3): its own entry of `rope_parameters`, else the family's default; never scaled."""
    params = raw.get("rope_parameters")
    if not isinstance(params, dict) or "sliding_attention" not in params:
        return default
    theta, scaling = parse_rope(raw, where, "sliding_attention")
    if scaling is not None:
        raise CheckpointError(f"{where}: scaling of the sliding layers' rotary embedding is not supported")
    return theta


def _olmo(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """OLMo 2 and OLMo 3: norms on each block's output only, q and k normalised over their whole projections;
    OLMo 3 adds sliding layers (three of every four), which rotate by a base of their own and unscaled."""
    extras: Extras = {
        "norm_layout": "post",
        "qk_norm": True,
        "qk_norm_span": "projection",
        "o_bias": common["attention_bias"],
    }
    if raw["model_type"] == "olmo3":
        layers = common["num_hidden_layers"]
        extras.update(_windows(raw, layers, where, lambda i: (i + 1) % 4 != 0, _window(raw, where, 4096)))
        # transformers gives OLMo 3's sliding layers its default base, whatever rope_theta says, and no scaling.
        extras["local_rope_theta"] = _local_theta(raw, where, 500_000.0)
        if "rope_theta" not in raw and not raw.get("rope_parameters"):
            extras["rope_theta"] = 500_000.0
    return _finish(raw, common, where, extras)


def _granite(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    extras = {
        "embed_scale": positive(raw, "embedding_multiplier", where, 1.0),
        "residual_scale": positive(raw, "residual_multiplier", where, 1.0),
        "attn_scale": positive(raw, "attention_multiplier", where, 1.0),
        "logits_divisor": positive(raw, "logits_scaling", where, 1.0),
        "o_bias": common["attention_bias"],
    }
    return _finish(raw, common, where, extras)


def _smollm3(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """SmolLM3: every `no_rope_layer_interval`-th layer has no rotary embedding (NoPE); where sliding windows are on,
    they are the NoPE layers'."""
    layers = common["num_hidden_layers"]
    interval = optional(raw, "no_rope_layer_interval", int, where, 4)
    rotated = flags(raw, "no_rope_layers", layers, where) or [(i + 1) % interval != 0 for i in range(layers)]
    window = _window(raw, where) if raw.get("use_sliding_window") is True else None
    extras = {
        **_windows(raw, layers, where, lambda i: not rotated[i], window),
        "nope_layers": frozenset(i for i in range(layers) if not rotated[i]),
        "tie_word_embeddings": optional(raw, "tie_word_embeddings", bool, where, True),
        "o_bias": common["attention_bias"],
    }
    return _finish(raw, common, where, extras)


def _gpt_oss(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """gpt-oss: every MLP is experts (a biased router, the top k logits softmaxed, clamped SwiGLU with biases),
    attention sinks, q/k/v/o biases, alternating sliding and full layers."""
    layers = common["num_hidden_layers"]
    extras = {
        **_windows(raw, layers, where, lambda i: bool((i + 1) % 2), _window(raw, where, 128)),
        "attention_bias": optional(raw, "attention_bias", bool, where, True),
        "o_bias": optional(raw, "attention_bias", bool, where, True),
        "sinks": True,
        "moe": gpt_oss_moe(raw, common["intermediate_size"], layers, where),
    }
    return _finish(raw, common, where, extras)


def _deepseek_v3(raw: dict[str, Any], common: Extras, where: str) -> Extras:
    """DeepSeek-V3: multi-head latent attention, and from `first_k_dense_replace` on, experts chosen by sigmoid
    scores with a bias correction within the best groups, beside shared experts."""
    layers = common["num_hidden_layers"]
    q_rank = optional(raw, "q_lora_rank", int, where, None)
    mla = MlaConfig(
        q_lora_rank=q_rank,
        kv_lora_rank=require(raw, "kv_lora_rank", int, where),
        qk_nope_head_dim=require(raw, "qk_nope_head_dim", int, where),
        qk_rope_head_dim=require(raw, "qk_rope_head_dim", int, where),
        v_head_dim=require(raw, "v_head_dim", int, where),
        rope_interleave=optional(raw, "rope_interleave", bool, where, True),
        mtp_layers=count(raw, "num_nextn_predict_layers", where),
    )
    for key, wanted in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if raw.get(key, wanted) != wanted:
            raise CheckpointError(f"{where}: {key}={raw[key]!r} is not supported; only {wanted!r} is")
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    scaling = common["rope_scaling"]
    if scaling is not None and scaling.kind == "yarn" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    extras = {
        "head_dim": mla.qk_rope_head_dim,
        "mla": mla,
        "attn_scale": scale,
        "o_bias": common["attention_bias"],
        "moe": deepseek_moe(raw, layers, where),
    }
    return _finish(raw, common, where, extras)


def _parse_freq_factors(raw: Any, head_dim: int, where: str) -> tuple[float, ...] | None:
    if raw is None:
        return None
    ok = isinstance(raw, list) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in raw
    )
    if not ok or len(raw) != head_dim // 2:
        raise CheckpointError(
            f"{where}: 'rope_freq_factors' must be {head_dim // 2} positive numbers, one per rotary frequency"
        )
    return tuple(float(v) for v in raw)


def _with_freq_factors(family: Callable[[dict[str, Any], Extras, str], Extras]) -> Callable[..., Extras]:
    """GGUF files give Llama 3.x scaling as one divisor per frequency (`rope_freq_factors`)."""

    def parse(raw: dict[str, Any], common: Extras, where: str) -> Extras:
        extras = family(raw, common, where)
        factors = _parse_freq_factors(raw.get("rope_freq_factors"), common["head_dim"], where)
        return {**extras, "rope_freq_factors": factors} if factors is not None else extras

    return parse


FAMILIES: dict[str, Callable[[dict[str, Any], Extras, str], Extras]] = {
    "llama": _with_freq_factors(_llama),
    "qwen2": _with_freq_factors(_qwen),
    "qwen3": _with_freq_factors(_qwen),
    "qwen3_moe": _with_freq_factors(_qwen),
    "mixtral": _every_layer_windowed,
    "mistral": _every_layer_windowed,
    "ministral": _every_layer_windowed,
    "ministral3": _ministral3,
    "phi3": _every_layer_windowed,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
    "olmo2": _olmo,
    "olmo3": _olmo,
    "granite": _granite,
    "smollm3": _smollm3,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
