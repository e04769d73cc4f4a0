"""Reading a GGUF file (llama.cpp's format) as a checkpoint: its config, its weights by Hugging Face name, its
digest and the tensor types it stores.

The `gguf` package (llama.cpp's own reader) parses the file and dequantises its tensors; nothing here parses bytes.
What this module adds is the translation into what the rest of the backend already reads from a Hugging Face
folder: the metadata becomes a raw config.json object that `checkpoint.parse_config` validates, the tensor names
become Hugging Face names with the shapes `checkpoint.expected_shapes` implies, and the q/k row permutation that
llama.cpp's converter applies to Llama checkpoints (for its interleaved rotary layout) is undone, so the model
computes the same function from either format. Every problem is a `CheckpointError` naming the file and what is
unsupported. The tokenizer is gguf_tokenizer.py's; the forward pass is model.py's.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pinned_backend.checkpoint import CheckpointError, ModelConfig, expected_shapes, parse_config

GGUF_SUFFIX = ".gguf"
# GGUF architecture name -> the config.json model_type that computes the same function.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Only llama.cpp's Llama converter permutes q/k rows; its Qwen converters keep Hugging Face's layout.
_PERMUTED_ARCHITECTURES = frozenset({"llama"})
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Llama 3.x frequency scaling, precomputed by the converter as one divisor per rotary frequency.
ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: Path) -> bool:
    return path.suffix.lower() == GGUF_SUFFIX and not path.is_dir()


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file: what it declares, read once; the tensors stay memory-mapped until `weights`."""

    path: Path
    architecture: str
    config: ModelConfig
    fields: dict[str, Any]  # every metadata key with its value, as the gguf package reads it
    stored_types: tuple[str, ...]  # the tensor types the file stores, most parameters first
    reader: gguf.GGUFReader

    def quantisation(self, compute_dtype: str) -> str:
        """The stack's `quantisation`: the stored types and the dtype they are dequantised to for compute,
        e.g. `gguf:Q4_1+Q8_0+F32->fp32`."""
        return f"gguf:{'+'.join(self.stored_types)}->{compute_dtype}"

    def weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor `expected_shapes(config)` names, dequantised, in Hugging Face's layout, in `dtype`."""
        expected = expected_shapes(self.config)
        tensors: dict[str, torch.Tensor] = {}
        for tensor in self.reader.tensors:
            if tensor.name == ROPE_FREQS:
                continue  # read into the config
            name = hugging_face_name(tensor.name)
            if name is None or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                raise CheckpointError(
                    f"{self.path}: unexpected tensor {tensor.name!r} for a {self.architecture}"
                )
            if name not in expected:
                raise CheckpointError(
                    f"{self.path}: unexpected tensor {tensor.name!r} for its metadata ({name} is not part of "
                    f"a {self.config.num_hidden_layers}-layer {self.architecture} with these options)"
                )
            values = torch.from_numpy(self._dequantise(tensor))
            if tuple(values.shape) != expected[name]:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name!r} has shape {tuple(values.shape)}, "
                    f"its metadata implies {expected[name]}"
                )
            if self.architecture in _PERMUTED_ARCHITECTURES:
                values = self._unpermuted(name, values)
            tensors[name] = values.to(dtype)
        missing = [name for name in expected if name not in tensors]
        if missing:
            raise CheckpointError(f"{self.path}: lacks {len(missing)} tensor(s), first {missing[0]!r}")
        return tensors

    def _dequantise(self, tensor: Any) -> np.ndarray:
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{self.path}: tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which the gguf "
                f"package cannot dequantise"
            ) from None
        # An F32 tensor comes back as a view of the read-only memory map; torch needs memory of its own.
        return values if values.flags.writeable and values.flags.c_contiguous else np.array(values)

    def _unpermuted(self, name: str, values: torch.Tensor) -> torch.Tensor:
        c = self.config
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return unpermute_rows(values, c.num_attention_heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return unpermute_rows(values, c.num_key_value_heads)
        return values


def unpermute_rows(values: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's `permute`: each head's rows from interleaved rotary pairs (0, d/2, 1, d/2 + 1,
    ...) back to Hugging Face's halves. [heads * head_dim, ...] -> the same shape."""
    half = values.shape[0] // heads // 2
    return values.reshape(heads, half, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)


def hugging_face_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    block, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if block != "blk" or not index.isdigit() or suffix not in _LAYER_NAMES:
        return None
    return f"model.layers.{int(index)}.{_LAYER_NAMES[suffix]}"


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Read a GGUF file's metadata and tensor table; a CheckpointError names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        reader = gguf.GGUFReader(path)
        fields = {name: field.contents() for name, field in reader.fields.items()}
    except (ValueError, KeyError, IndexError, OSError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file: {exc}") from None
    architecture = fields.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    names = {tensor.name for tensor in reader.tensors}
    raw = config_json(fields, architecture, names, str(path))
    raw["rope_freq_factors"] = _rope_freq_factors(reader, path)
    config = parse_config(raw, where=str(path))
    return GGUFCheckpoint(path, architecture, config, fields, _stored_types(reader), reader)


def config_json(
    fields: dict[str, Any], architecture: str, tensor_names: set[str], where: str
) -> dict[str, Any]:
    """The config.json object the metadata describes, for `parse_config` to validate like any other."""
    arch = architecture

    def get(key: str) -> Any:
        return fields.get(f"{arch}.{key}")

    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{where}: {arch}.rope.scaling.type {scaling!r} is not supported")
    heads = get("attention.head_count")
    if isinstance(heads, list):
        raise CheckpointError(
            f"{where}: per-layer head counts ({arch}.attention.head_count) are not supported"
        )
    hidden = get("embedding_length")
    head_dim = get("attention.key_length")
    if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    for key, value in (
        ("attention.value_length", get("attention.value_length")),
        ("rope.dimension_count", get("rope.dimension_count")),
    ):
        if value is not None and value != head_dim:
            raise CheckpointError(
                f"{where}: {arch}.{key} {value} differs from the head size {head_dim}; only full rotary "
                f"embeddings over equal key and value heads are supported"
            )
    vocab = get("vocab_size")
    if vocab is None and isinstance(fields.get("tokenizer.ggml.tokens"), list):
        vocab = len(fields["tokenizer.ggml.tokens"])
    raw = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv")
        if get("attention.head_count_kv") is not None
        else heads,
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base") if get("rope.freq_base") is not None else 10000.0,
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
    }
    missing = [key for key, value in raw.items() if value is None]
    if missing:
        raise CheckpointError(f"{where}: metadata lacks what gives {missing[0]!r} (keys under {arch}.)")
    return raw


def _rope_freq_factors(reader: gguf.GGUFReader, path: Path) -> list[float] | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise CheckpointError(f"{path}: {ROPE_FREQS} must be F32, not {tensor.tensor_type.name}")
            return [float(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    return None


def _stored_types(reader: gguf.GGUFReader) -> tuple[str, ...]:
    elements: Counter[str] = Counter()
    for tensor in reader.tensors:
        elements[tensor.tensor_type.name] += int(tensor.n_elements)
    return tuple(sorted(elements, key=lambda name: (-elements[name], name)))


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file's bytes: a GGUF's `weights_sha256` (the name it has on disk plays no part)."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
