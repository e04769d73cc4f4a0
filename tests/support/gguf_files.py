"""Small GGUF files written with the gguf package's own writer, as llama.cpp's converter lays them out, for the
loader's tests: Hugging Face tensors renamed to GGUF names, Llama's q/k rows permuted for llama.cpp's interleaved
rotary layout, chosen tensors quantised, and a byte-level BPE tokenizer's vocabulary and merges as metadata."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pinned_backend.checkpoint import ModelConfig, expected_shapes, parse_config

# llama.cpp's tensor names (gguf-py's TENSOR_NAMES), written out here rather than taken from the loader under test.
_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to a Llama q or k projection (its `LlamaModel.permute`)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{_GGUF_LAYER_NAMES[rest]}"


def write_gguf(
    path: Path,
    architecture: str,
    config: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    *,
    quantise: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    tokenizer: RawTokenizer | None = None,
    pre: str = "gpt-2",
    extra: Mapping[str, Any] | None = None,
    raw_tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """`tensors` by Hugging Face name; `quantise` maps some of those names to a GGML type (the rest stay F32);
    `extra` adds metadata keys (str, int, float or bool values); `raw_tensors` adds tensors by GGUF name as given."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        _add_tokenizer(writer, tokenizer, pre)
    for key, value in (extra or {}).items():
        _add_value(writer, key, value)
    for name, tensor in tensors.items():
        values = tensor.float().numpy()
        if architecture == "llama" and name.endswith("q_proj.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        if architecture == "llama" and name.endswith("k_proj.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        qtype = (quantise or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(values, dtype=np.float32))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for name, values in (raw_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: RawTokenizer, pre: str) -> None:
    model = json.loads(tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab]
    special = {added.content for added in tokenizer.get_added_tokens_decoder().values() if added.special}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_string(key, value)


SMALL_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
_TEXT = ["the cat sat on the mat", "a dog ran in the park", "hello there, how are you today?"] * 10
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_small_gguf(path: Path, architecture: str = "llama") -> Path:
    """A random two-layer model of `architecture` with a byte-level BPE tokenizer, ChatML template and Q8_0
    embeddings: a whole servable GGUF file of a few hundred kilobytes."""
    tokenizer = RawTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_TEXT, trainer)
    tokenizer.add_special_tokens(_SPECIALS)
    config = parse_config({**SMALL_LLAMA, "vocab_size": tokenizer.get_vocab_size()})
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        for name, shape in expected_shapes(config).items()
    }
    extra = {
        "tokenizer.ggml.eos_token_id": tokenizer.token_to_id("<|im_end|>"),
        "tokenizer.chat_template": _CHATML,
    }
    quantise = {"model.embed_tokens.weight": gguf.GGMLQuantizationType.Q8_0}
    return write_gguf(
        path, architecture, config, tensors, quantise=quantise, tokenizer=tokenizer, extra=extra
    )
