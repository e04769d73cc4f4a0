"""Specification of the checkpoint reader: config parsing, weight loading (single file and sharded), digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pinned_backend.checkpoint import (
    CheckpointError,
    expected_shapes,
    load_config,
    load_weights,
    parse_config,
    weights_sha256,
)
from tests.support.family_checkpoints import write_family_checkpoint

QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rope_scaling": None,
}
LLAMA32 = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
}


def write_checkpoint(folder: Path, raw: dict[str, Any], shards: int = 1) -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in expected_shapes(parse_config(raw)).items()
    }
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return tensors
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(folder / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def test_qwen3_config_derives_qk_norm_and_keeps_explicit_head_dim() -> None:
    config = parse_config(QWEN3)
    assert config.qk_norm and config.tie_word_embeddings and not config.attention_bias
    assert config.head_dim == 16 and config.q_size == 64 and config.kv_size == 32
    assert config.rope_scaling is None


def test_llama_config_derives_head_dim_and_parses_llama3_rope_scaling() -> None:
    config = parse_config(LLAMA32)
    assert config.head_dim == 8 and not config.qk_norm and not config.tie_word_embeddings
    assert config.rope_scaling is not None and config.rope_scaling.factor == 32.0
    assert config.rope_scaling.original_max_position_embeddings == 64


def test_keys_real_configs_carry_beyond_the_ones_used_are_accepted() -> None:
    extra = {
        "architectures": ["Qwen3ForCausalLM"],
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "transformers_version": "4.51.0",
        "mlp_bias": False,
        "pretraining_tp": 1,
    }
    assert parse_config({**QWEN3, **extra}) == parse_config(QWEN3)


def test_qwen2_config_has_attention_biases() -> None:
    config = parse_config({**QWEN3, "model_type": "qwen2"})
    assert config.attention_bias and not config.qk_norm
    assert "model.layers.0.self_attn.q_proj.bias" in expected_shapes(config)


QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_hidden_layers": 6,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 24,
    "norm_topk_prob": True,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}


def test_qwen3_moe_config_places_experts_as_hugging_face_does() -> None:
    config = parse_config(QWEN3_MOE)
    assert config.qk_norm and config.moe is not None
    # Every second layer (1, 3, 5) is sparse, except 3, which mlp_only_layers keeps dense.
    assert config.moe.sparse_layers == {1, 5} and config.moe.norm_topk_prob
    shapes = expected_shapes(config)
    assert shapes["model.layers.1.mlp.gate.weight"] == (8, 32)
    assert shapes["model.layers.1.mlp.experts.7.gate_proj.weight"] == (24, 32)
    assert shapes["model.layers.5.mlp.experts.0.down_proj.weight"] == (32, 24)
    assert shapes["model.layers.3.mlp.gate_proj.weight"] == (48, 32)
    assert "model.layers.1.mlp.gate_proj.weight" not in shapes
    # Hugging Face's defaults: every layer sparse, top-k probabilities not renormalised.
    plain = parse_config(
        {
            k: v
            for k, v in QWEN3_MOE.items()
            if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")
        }
    )
    assert plain.moe is not None and plain.moe.sparse_layers == set(range(6)) and not plain.moe.norm_topk_prob


def test_mixtral_config_makes_every_mlp_its_experts() -> None:
    raw = {
        **LLAMA32,
        "model_type": "mixtral",
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_scaling": None,
    }
    config = parse_config(raw)
    assert config.moe is not None and config.moe.sparse_layers == {0, 1} and config.moe.norm_topk_prob
    shapes = expected_shapes(config)
    assert shapes["model.layers.0.block_sparse_moe.gate.weight"] == (4, 32)
    assert shapes["model.layers.1.block_sparse_moe.experts.3.w2.weight"] == (32, 48)
    windowed = parse_config({**raw, "sliding_window": 4096})
    assert windowed.sliding_window == 4096 and windowed.sliding_layers == {0, 1}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 is more than the 8 experts"),
        ({"num_experts": 0}, "'num_experts' must be positive"),
        ({"mlp_only_layers": [6]}, "'mlp_only_layers' must be a list of layer indices below 6"),
        ({"mlp_only_layers": "all"}, "'mlp_only_layers' must be a list"),
        ({"norm_topk_prob": 1}, "'norm_topk_prob' must be true or false"),
    ],
)
def test_malformed_moe_config_is_an_error_naming_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        parse_config({**QWEN3_MOE, **change}, where="folder/config.json")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_size": None}, "'hidden_size' must be an integer"),
        ({"hidden_size": True}, "'hidden_size' must be an integer"),
        ({"num_hidden_layers": 0}, "'num_hidden_layers' must be positive"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"rms_norm_eps": "small"}, "'rms_norm_eps' must be a number"),
        ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            "rope_scaling type 'dynamic' is not supported",
        ),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing key 'low_freq_factor'"),
        ({"layer_types": ["chunked_attention"] * 2}, "'layer_types' must list 2 of"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_malformed_config_is_an_error_naming_the_file_and_the_key(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        parse_config({**QWEN3, **change}, where="folder/config.json")
    assert message in str(info.value)


def test_missing_required_key_is_named() -> None:
    raw = dict(QWEN3)
    del raw["vocab_size"]
    with pytest.raises(CheckpointError, match="missing key 'vocab_size'"):
        parse_config(raw)


def test_missing_or_invalid_config_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("raw", [QWEN3, LLAMA32], ids=["qwen3", "llama3.2"])
def test_weights_load_by_hugging_face_name_in_the_chosen_dtype(
    tmp_path: Path, raw: dict, shards: int
) -> None:
    written = write_checkpoint(tmp_path, raw, shards=shards)
    config = load_config(tmp_path)
    loaded = load_weights(tmp_path, config, torch.float32)
    assert set(loaded) == set(written)
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, written[name].float()), name


def test_tied_checkpoint_may_still_carry_an_lm_head(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path, QWEN3)
    tensors["lm_head.weight"] = torch.zeros(96, 32, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in load_weights(tmp_path, parse_config(QWEN3), torch.bfloat16)


def test_missing_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path, QWEN3)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)


def test_wrong_shape_is_an_error_naming_file_tensor_and_both_shapes(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path, QWEN3)
    tensors["model.norm.weight"] = torch.ones(31)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'model\.norm\.weight'.*\(31,\).*\(32,\)"):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)


def test_unexpected_tensor_is_an_error(tmp_path: Path) -> None:
    tensors = write_checkpoint(tmp_path, QWEN3)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.ones(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)


def test_corrupt_or_absent_weight_files_are_errors_naming_them(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN3)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"no model\.safetensors and no model\.safetensors\.index\.json"
    ):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)


def test_shard_listed_in_the_index_but_absent_is_an_error_naming_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN3, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: file not found"):
        load_weights(tmp_path, parse_config(QWEN3), torch.float32)


def test_weights_sha256_hashes_each_file_digest_in_file_name_order(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN3, shards=3)
    lines = "".join(
        f"{path.name}:{hashlib.sha256(path.read_bytes()).hexdigest()}\n"
        for path in sorted(tmp_path.glob("*.safetensors"))
    )
    assert weights_sha256(tmp_path) == hashlib.sha256(lines.encode()).hexdigest()


def test_weights_sha256_changes_when_one_byte_of_a_shard_changes(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, QWEN3, shards=2)
    before = weights_sha256(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert weights_sha256(tmp_path) != before


def test_multi_token_prediction_layers_after_the_last_are_loaded_and_ignored(tmp_path: Path) -> None:
    folder = write_family_checkpoint(tmp_path / "deepseek", "deepseek_v3")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    tensors["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(24, 32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.2\.eh_proj\.weight'"):
        load_weights(folder, load_config(folder), torch.float32)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    loaded = load_weights(folder, load_config(folder), torch.float32)
    assert not any(name.startswith("model.layers.2.") for name in loaded)
