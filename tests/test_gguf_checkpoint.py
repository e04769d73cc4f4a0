"""Specification of the GGUF reader: metadata to config, tensors to Hugging Face names and layout (Llama's q/k
permutation undone), the stored types and digest the stack names, and errors that name the file and what is
unsupported. Files are written with the gguf package's writer as llama.cpp's converter writes them."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pinned_backend.checkpoint import CheckpointError, ModelConfig, expected_shapes, parse_config
from pinned_backend.gguf_checkpoint import file_sha256, open_gguf, unpermute_rows
from pinned_backend.kernels import select_kernels
from pinned_backend.model import Transformer, rope_inv_freq
from tests.support.gguf_files import llama_cpp_permute, write_gguf
from tests.test_model import VARIANTS, Runner, write_folder

CPU = torch.device("cpu")
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
# Architectures as their GGUF files name them, with configs of the sizes test_model.py uses.
SMALL = {
    "llama": {**VARIANTS["llama3.2"], "rope_scaling": None, "max_position_embeddings": 256},
    "qwen3": {**VARIANTS["qwen3"], "max_position_embeddings": 256},
    "qwen2": {**VARIANTS["qwen2"], "max_position_embeddings": 256},
}


def random_tensors(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        for name, shape in expected_shapes(config).items()
    }


def write(tmp_path: Path, arch: str = "llama", name: str = "model.gguf", **options: Any) -> Path:
    config = parse_config(SMALL[arch])
    return write_gguf(tmp_path / name, arch, config, random_tensors(config), **options)


def test_the_permutation_undone_is_the_inverse_of_llama_cpps() -> None:
    weights = torch.randn(4 * 8, 5)
    permuted = torch.from_numpy(llama_cpp_permute(weights.numpy(), heads=4))
    assert not torch.equal(permuted, weights)
    assert torch.equal(unpermute_rows(permuted, heads=4), weights)


@pytest.mark.parametrize("arch", list(SMALL))
def test_a_gguf_gives_the_hugging_face_tensors_it_was_converted_from(tmp_path: Path, arch: str) -> None:
    config = parse_config(SMALL[arch])
    tensors = random_tensors(config)
    checkpoint = open_gguf(write_gguf(tmp_path / "m.gguf", arch, config, tensors))
    # GGUF keeps numbers in float32; transformers reads the same rounded epsilon.
    assert checkpoint.config == dataclasses.replace(
        config, rms_norm_eps=float(np.float32(config.rms_norm_eps))
    )
    loaded = checkpoint.weights(torch.float32)
    assert set(loaded) == set(tensors)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, tensors[name]), f"{name} differs from the tensor the file was made from"


def test_llama_from_gguf_computes_the_logits_of_the_same_weights_from_a_folder(tmp_path: Path) -> None:
    raw = SMALL["llama"]
    weights = write_folder(tmp_path / "folder", raw)
    path = write_gguf(tmp_path / "m.gguf", "llama", parse_config(raw), weights)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(3))
    logits = []
    for source in (tmp_path / "folder", path):
        model = Transformer.from_pretrained(source, select_kernels("default", CPU), CPU, torch.float32)
        runner = Runner(model, [ids])
        runner.step([(0, 40)])
        logits.append(torch.stack(runner.logits[0]))
    assert torch.equal(logits[0], logits[1]), "the GGUF's model must be the folder's, bit for bit"


def test_quantised_tensors_are_dequantised_by_the_gguf_package(tmp_path: Path) -> None:
    config = parse_config(SMALL["llama"])
    tensors = random_tensors(config)
    quantise = {"model.embed_tokens.weight": Q8_0, "model.layers.0.mlp.up_proj.weight": Q4_1}
    checkpoint = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", config, tensors, quantise=quantise))
    loaded = checkpoint.weights(torch.float32)
    embed = tensors["model.embed_tokens.weight"].numpy()
    expected = gguf.quants.dequantize(gguf.quants.quantize(embed, Q8_0), Q8_0)
    assert torch.equal(loaded["model.embed_tokens.weight"], torch.from_numpy(expected))
    up = loaded["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(up, tensors["model.layers.0.mlp.up_proj.weight"]), "Q4_1 rounds"
    torch.testing.assert_close(up, tensors["model.layers.0.mlp.up_proj.weight"], atol=0.1, rtol=0)
    assert loaded["model.norm.weight"].dtype == torch.float32
    assert checkpoint.weights(torch.bfloat16)["model.norm.weight"].dtype == torch.bfloat16


def test_stored_types_are_named_most_parameters_first_with_the_compute_dtype(tmp_path: Path) -> None:
    # The embedding (512 x 256) outweighs the one Q4_1 matrix (512 x 256 too, ties go by name) and the rest.
    quantise = {"model.embed_tokens.weight": Q8_0}
    config = parse_config(SMALL["llama"])
    tensors = random_tensors(config)
    quantise.update(dict.fromkeys((n for n in tensors if n.endswith("proj.weight")), Q4_1))
    checkpoint = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", config, tensors, quantise=quantise))
    assert checkpoint.stored_types == ("Q4_1", "F32", "Q8_0")
    assert checkpoint.quantisation("fp32") == "gguf:Q4_1+F32+Q8_0->fp32"


def test_an_absent_output_tensor_means_tied_embeddings(tmp_path: Path) -> None:
    config = parse_config(SMALL["qwen3"])
    assert config.tie_word_embeddings
    checkpoint = open_gguf(write_gguf(tmp_path / "m.gguf", "qwen3", config, random_tensors(config)))
    assert checkpoint.config.tie_word_embeddings and "lm_head.weight" not in checkpoint.weights(torch.float32)


def test_rope_freqs_divide_the_rotary_frequencies_as_llama3_scaling_does(tmp_path: Path) -> None:
    scaled = {**VARIANTS["llama3.2"], "max_position_embeddings": 256}
    reference = rope_inv_freq(parse_config(scaled))
    plain = rope_inv_freq(parse_config(SMALL["llama"]))
    # llama.cpp's converter stores one divisor per frequency instead of the scaling parameters.
    factors = (plain / reference).numpy().astype(np.float32)
    path = write(tmp_path, raw_tensors={"rope_freqs.weight": factors})
    config = open_gguf(path).config
    assert config.rope_freq_factors is not None and len(config.rope_freq_factors) == config.head_dim // 2
    torch.testing.assert_close(rope_inv_freq(config), reference, rtol=1e-6, atol=0)
    assert "rope_freqs.weight" not in open_gguf(path).weights(torch.float32)


def test_the_digest_is_the_files_sha256_whatever_its_name(tmp_path: Path) -> None:
    path = write(tmp_path)
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    renamed = path.rename(tmp_path / "another-name.gguf")
    assert file_sha256(renamed) == hashlib.sha256(renamed.read_bytes()).hexdigest()


def test_another_architecture_is_an_error_naming_the_file_and_it(tmp_path: Path) -> None:
    config = parse_config(SMALL["llama"])
    path = write_gguf(tmp_path / "phi.gguf", "phi3", config, random_tensors(config))
    with pytest.raises(
        CheckpointError, match=r"phi\.gguf: architecture 'phi3' is not supported; supported: llama"
    ):
        open_gguf(path)


def test_a_tensor_type_the_reader_cannot_dequantise_is_named(tmp_path: Path) -> None:
    config = parse_config(SMALL["llama"])
    tensors = random_tensors(config)
    del tensors["model.layers.0.input_layernorm.weight"]
    raw = {"blk.0.attn_norm.weight": np.ones(256, dtype=np.int8)}
    checkpoint = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", config, tensors, raw_tensors=raw))
    with pytest.raises(CheckpointError, match=r"'blk\.0\.attn_norm\.weight' is stored as I8, which the gguf"):
        checkpoint.weights(torch.float32)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"llama.rope.scaling.type": "yarn"}, r"llama\.rope\.scaling\.type 'yarn' is not supported"),
        (
            {"llama.rope.dimension_count": 16},
            r"llama\.rope\.dimension_count 16 differs from the head size 64",
        ),
    ],
)
def test_unsupported_metadata_is_an_error_naming_the_key(tmp_path: Path, extra: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        open_gguf(write(tmp_path, extra=extra))


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"broken\.gguf: not a readable GGUF file"):
        open_gguf(path)
    with pytest.raises(CheckpointError, match=r"absent\.gguf: file not found"):
        open_gguf(tmp_path / "absent.gguf")


def test_a_missing_or_misshapen_tensor_is_named(tmp_path: Path) -> None:
    config = parse_config(SMALL["llama"])
    tensors = random_tensors(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"lacks 1 tensor\(s\), first 'model\.layers\.1\.mlp\.up_proj"):
        open_gguf(write_gguf(tmp_path / "a.gguf", "llama", config, tensors)).weights(torch.float32)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.ones(3, 256)
    with pytest.raises(CheckpointError, match=r"'blk\.1\.ffn_up\.weight' has shape \(3, 256\).*\(512, 256\)"):
        open_gguf(write_gguf(tmp_path / "b.gguf", "llama", config, tensors)).weights(torch.float32)


def test_head_size_comes_from_key_length_when_it_is_not_hidden_over_heads(tmp_path: Path) -> None:
    config = open_gguf(write(tmp_path, "qwen3")).config
    assert config.head_dim == 32 and config.hidden_size // config.num_attention_heads == 64
    assert config.qk_norm and not config.attention_bias
    assert open_gguf(write(tmp_path, "qwen2", name="q2.gguf")).config.attention_bias
    assert math.isclose(config.rms_norm_eps, 1e-6, rel_tol=1e-6)
