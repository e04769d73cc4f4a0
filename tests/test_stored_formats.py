"""Specification of the packed weight formats (pinned_backend.stored_formats): MXFP4 experts decode as transformers
decodes them, and a gpt-oss checkpoint stored so serves what transformers serves from it; FP8 blocks decode to their
values times their block's scale; the stack names the stored format; a format the backend cannot read is refused by
name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pinned_backend.checkpoint import CheckpointError, load_config, load_weights
from pinned_backend.kernels import select_kernels
from pinned_backend.loading import load_checkpoint
from pinned_backend.model import Transformer
from pinned_backend.stored_formats import fp8_decode, mxfp4_decode
from tests.support.family_checkpoints import write_family_checkpoint
from tests.test_model import Runner

CPU = torch.device("cpu")
MXFP4 = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
}


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., rows, K / 32, 16] and scales [..., rows, K / 32] for a tensor [..., rows, K] of small values."""
    *rows, k = shape
    blocks = torch.randint(0, 256, (*rows, k // 32, 16), generator=generator, dtype=torch.uint8)
    return blocks, torch.randint(121, 128, (*rows, k // 32), generator=generator, dtype=torch.uint8)


def test_mxfp4_decodes_as_transformers_decodes() -> None:
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = random_mxfp4((3, 40, 96), torch.Generator().manual_seed(0))
    expected = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    assert torch.equal(mxfp4_decode(blocks, scales).transpose(1, 2), expected)


def write_packed_gpt_oss(folder: Path) -> Path:
    """The tiny gpt-oss checkpoint with its experts stored as the Hub stores them: MXFP4 blocks and scales."""
    write_family_checkpoint(folder, "gpt_oss")
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    config = json.loads((folder / "config.json").read_text())
    experts, hidden, size = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        for name, shape in (
            ("gate_up_proj", (experts, 2 * size, hidden)),
            ("down_proj", (experts, hidden, size)),
        ):
            del tensors[p + name]
            tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = random_mxfp4(shape, generator)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4}))
    return folder


def test_a_gpt_oss_checkpoint_stored_in_mxfp4_serves_what_transformers_serves_from_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = write_packed_gpt_oss(tmp_path / "gpt-oss")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32
    )  # it decodes too
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    model = Transformer.from_pretrained(folder, select_kernels("batch_invariant", CPU), CPU, torch.float32)
    runner = Runner(model, [ids])
    runner.step([(0, 30)])
    torch.testing.assert_close(torch.stack(runner.logits[0]), expected, atol=1e-4, rtol=1e-4)
    assert load_checkpoint(folder, torch.bfloat16).quantisation == "mxfp4->bf16"


def test_fp8_blocks_decode_to_their_values_times_their_blocks_scale() -> None:
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 300, generator=generator).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=generator) + 0.5
    decoded = fp8_decode(weight, scale_inv)
    for row, col in ((0, 0), (127, 127), (128, 0), (199, 299), (5, 200)):
        expected = weight[row, col].float() * scale_inv[row // 128, col // 128]
        assert decoded[row, col] == expected
    with pytest.raises(CheckpointError, match=r"needs scales of shape \(2, 3\)"):
        fp8_decode(weight, scale_inv[:1])


def test_a_checkpoint_stored_in_fp8_blocks_loads_its_decoded_weights(tmp_path: Path) -> None:
    folder = write_family_checkpoint(tmp_path / "deepseek", "deepseek_v3")
    plain = load_weights(folder, load_config(folder), torch.float32)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        stored = tensors[name].to(torch.float8_e4m3fn)
        scale = torch.full((-(-stored.shape[0] // 128), -(-stored.shape[1] // 128)), 0.5)
        tensors[name], tensors[name + "_scale_inv"] = stored, scale
        plain[name] = stored.float() * 0.5
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    fp8 = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": fp8}))
    loaded = load_weights(folder, load_config(folder), torch.float32)
    assert loaded.keys() == plain.keys()
    assert all(torch.equal(loaded[name], plain[name]) for name in plain)
    assert load_checkpoint(folder, torch.float32).quantisation == "fp8->fp32"


def test_a_stored_format_the_backend_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    folder = write_family_checkpoint(tmp_path / "mistral", "mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "awq"}})
    )
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported; supported: mxfp4, fp8"):
        load_checkpoint(folder, torch.float32)


def test_blocks_without_their_scales_are_an_error_naming_them(tmp_path: Path) -> None:
    folder = write_packed_gpt_oss(tmp_path / "gpt-oss")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks' has no"):
        load_weights(folder, load_config(folder), torch.float32)
