"""Reading a Hugging Face checkpoint folder: its config, its weight tensors and the digest of its weight
files.

A folder holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. This module turns `config.json` into a frozen `ModelConfig` (with a `MoeConfig`
for a mixture-of-experts model: Qwen3-MoE or Mixtral), loads the
tensors by their Hugging Face names with the shapes that config implies, and computes `weights_sha256`
exactly as docs/protocol.md defines it. Every problem with the folder is a `CheckpointError` that names the
file and what is wrong with it. It knows nothing of how the tensors are arranged for the forward pass
(model.py) or of tokenizers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pinned_backend.digests import files_sha256

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
# Tensors some exporters add that carry nothing the forward pass needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint folder is missing a file, or a file in it is malformed. The message names the file."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x frequency scaling (`rope_scaling` with `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP layers of a mixture-of-experts model, in the checkpoint's naming `layout`."""

    layout: (
        str  # "qwen3_moe": mlp.gate, mlp.experts.E.{gate,up,down}_proj; "mixtral": block_sparse_moe..w1/w3/w2
    )
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to one
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts; the others are dense


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    moe: MoeConfig | None = None
    # One divisor per rotary frequency [head_dim / 2], as GGUF files carry Llama 3.x scaling (`rope_freqs`).
    rope_freq_factors: tuple[float, ...] | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _require(raw: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in raw:
        raise CheckpointError(f"{where}: missing key {key!r}")
    value = raw[key]
    # bool is an int in Python; a config that says `"hidden_size": true` is still wrong.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise CheckpointError(f"{where}: {key!r} must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise CheckpointError(f"{where}: {key!r} must be a number, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise CheckpointError(f"{where}: {key!r} must be finite, got {value!r}")
    if kind is int and value <= 0:
        raise CheckpointError(f"{where}: {key!r} must be positive, got {value!r}")
    return kind(value)


def _parse_rope_scaling(raw: Any, where: str) -> RopeScaling | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: 'rope_scaling' must be an object or null, got {raw!r}")
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise CheckpointError(
            f"{where}: rope_scaling type {rope_type!r} is not supported; supported: 'llama3' or none"
        )
    sub = f"{where} rope_scaling"
    scaling = RopeScaling(
        factor=_require(raw, "factor", float, sub),
        low_freq_factor=_require(raw, "low_freq_factor", float, sub),
        high_freq_factor=_require(raw, "high_freq_factor", float, sub),
        original_max_position_embeddings=_require(raw, "original_max_position_embeddings", int, sub),
    )
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise CheckpointError(f"{sub}: 'high_freq_factor' must be larger than 'low_freq_factor'")
    return scaling


def _parse_moe(raw: dict[str, Any], model_type: str, layers: int, where: str) -> MoeConfig | None:
    """Qwen3-MoE's keys as Hugging Face's Qwen3MoeConfig reads them (its defaults where a key is absent); Mixtral's
    experts are every layer's MLP, their top-k always renormalised."""
    if model_type == "mixtral":
        experts, size = (
            _require(raw, "num_local_experts", int, where),
            _require(raw, "intermediate_size", int, where),
        )
        sparse, norm = frozenset(range(layers)), True
    elif model_type == "qwen3_moe":
        experts, size = (
            _require(raw, "num_experts", int, where),
            _require(raw, "moe_intermediate_size", int, where),
        )
        step = _require(raw, "decoder_sparse_step", int, where) if "decoder_sparse_step" in raw else 1
        dense = raw.get("mlp_only_layers", [])
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
            raise CheckpointError(
                f"{where}: 'mlp_only_layers' must be a list of layer indices below {layers}"
            )
        sparse = frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        norm = raw.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise CheckpointError(f"{where}: 'norm_topk_prob' must be true or false, got {norm!r}")
    else:
        return None
    top_k = _require(raw, "num_experts_per_tok", int, where)
    if top_k > experts:
        raise CheckpointError(f"{where}: num_experts_per_tok {top_k} is more than the {experts} experts")
    return MoeConfig(model_type, experts, top_k, size, norm, sparse)


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


def parse_config(raw: Any, where: str = CONFIG_FILE) -> ModelConfig:
    """Validate a parsed config.json object; `where` names the file in error messages."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object at the top level")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{where}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key, unsupported in (("use_sliding_window", True), ("mlp_bias", True)):
        if raw.get(key) is unsupported:
            raise CheckpointError(f"{where}: {key}={unsupported!r} is not supported")
    if model_type == "mixtral" and raw.get("sliding_window") is not None:
        raise CheckpointError(
            f"{where}: sliding_window={raw['sliding_window']!r} is not supported; only null is"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; only 'silu' is")
    hidden = _require(raw, "hidden_size", int, where)
    heads = _require(raw, "num_attention_heads", int, where)
    kv_heads = _require(raw, "num_key_value_heads", int, where) if "num_key_value_heads" in raw else heads
    if raw.get("head_dim") is not None:
        head_dim = _require(raw, "head_dim", int, where)
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
    if head_dim % 2 != 0:
        raise CheckpointError(f"{where}: head_dim {head_dim} must be even for rotary embeddings")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"{where}: 'tie_word_embeddings' must be true or false, got {tie!r}")
    # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
    bias = model_type == "qwen2" or raw.get("attention_bias", False) is True
    layers = _require(raw, "num_hidden_layers", int, where)
    return ModelConfig(
        model_type=model_type,
        vocab_size=_require(raw, "vocab_size", int, where),
        hidden_size=hidden,
        intermediate_size=_require(raw, "intermediate_size", int, where),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_require(raw, "rms_norm_eps", float, where),
        rope_theta=_require(raw, "rope_theta", float, where) if "rope_theta" in raw else 10000.0,
        max_position_embeddings=_require(raw, "max_position_embeddings", int, where),
        tie_word_embeddings=tie,
        attention_bias=bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=_parse_rope_scaling(raw.get("rope_scaling"), where),
        moe=_parse_moe(raw, model_type, layers, where),
        rope_freq_factors=_parse_freq_factors(raw.get("rope_freq_factors"), head_dim, where),
    )


def read_json(path: Path) -> Any:
    """Parse a JSON file, turning a missing or malformed file into a CheckpointError naming it."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None


def load_config(folder: Path) -> ModelConfig:
    path = folder / CONFIG_FILE
    return parse_config(read_json(path), where=str(path))


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass needs, by Hugging Face name, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, c.hidden_size)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, c.hidden_size)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
        if c.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (c.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (c.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (c.kv_size,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
        if c.moe is not None and i in c.moe.sparse_layers:
            shapes.update(_expert_shapes(p, c.hidden_size, c.moe))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    return shapes


def expert_names(prefix: str, moe: MoeConfig) -> tuple[str, list[tuple[str, str, str]]]:
    """A sparse layer's router weight name and each expert's (gate, up, down) weight names, in expert order."""
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


def _expert_shapes(prefix: str, hidden: int, moe: MoeConfig) -> dict[str, tuple[int, ...]]:
    router, experts = expert_names(prefix, moe)
    size = moe.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {router: (moe.num_experts, hidden)}
    for gate, up, down in experts:
        shapes.update({gate: (size, hidden), up: (size, hidden), down: (hidden, size)})
    return shapes


def weight_files(folder: Path) -> dict[str, list[str]]:
    """Map each weight file's name to the tensor names it holds, following the shard index if there is one."""
    index_path = folder / WEIGHTS_INDEX_FILE
    if index_path.exists():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: expected a non-empty 'weight_map' object")
        files: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise CheckpointError(
                    f"{index_path}: tensor {name!r} maps to an invalid file name {file_name!r}"
                )
            files.setdefault(file_name, []).append(name)
        return files
    if (folder / SINGLE_WEIGHTS_FILE).exists():
        return {SINGLE_WEIGHTS_FILE: []}
    raise CheckpointError(f"{folder}: no {SINGLE_WEIGHTS_FILE} and no {WEIGHTS_INDEX_FILE}")


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Load every tensor `expected_shapes` names, checked for shape, converted to `dtype`, on the CPU."""
    expected = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for file_name, indexed_names in sorted(weight_files(folder).items()):
        path = folder / file_name
        if not path.exists():
            raise CheckpointError(f"{path}: file not found (listed in {WEIGHTS_INDEX_FILE})")
        try:
            with safe_open(str(path), framework="pt") as handle:
                names = list(handle.keys())
                missing_here = set(indexed_names) - set(names)
                if missing_here:
                    raise CheckpointError(
                        f"{path}: does not hold {sorted(missing_here)[0]!r}, "
                        f"which {WEIGHTS_INDEX_FILE} places here"
                    )
                for name in names:
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue
                    if name not in expected:
                        raise CheckpointError(f"{path}: unexpected tensor {name!r} for this config.json")
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} appears in more than one weight file")
                    tensor = handle.get_tensor(name)
                    if tuple(tensor.shape) != expected[name]:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"config.json implies {expected[name]}"
                        )
                    if not tensor.is_floating_point():
                        raise CheckpointError(f"{path}: tensor {name!r} has non-float dtype {tensor.dtype}")
                    tensors[name] = tensor.to(dtype)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: weight files lack {len(missing)} tensor(s), first {missing[0]!r}")
    return tensors


def weights_sha256(folder: Path) -> str:
    """SHA-256 over each `*.safetensors` file's own SHA-256, in file-name order, as `name:hex\\n` lines."""
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files to digest")
    return files_sha256((path.name, path) for path in files)
