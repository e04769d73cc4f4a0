"""Specification of pinned_backend.runtime: settings validation, and a stack built from what was loaded."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from pinned_backend.checkpoint import CheckpointError, weights_sha256
from pinned_backend.kvcache import KV_CONTEXTS, PagedKVCache
from pinned_backend.runtime import BackendSettings, load_runtime
from pinned_backend.stack import STACK_KEYS, fingerprint
from tests.support.backend_checkpoint import MOE_CONFIG, write_random_checkpoint
from tests.support.gguf_files import write_small_gguf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("runtime") / "random-qwen3", with_tokenizer=True)


def test_settings_refuse_inconsistent_batching() -> None:
    with pytest.raises(ValidationError, match="max_step_tokens"):
        BackendSettings(model=Path("."), max_batch_size=32, max_step_tokens=16)
    with pytest.raises(ValidationError, match="multiple of the KV cache's block size"):
        BackendSettings(model=Path("."), block_size=16, kv_split_size=24)
    with pytest.raises(ValidationError, match="kernel_mode"):
        BackendSettings(model=Path("."), kernel_mode="fast")  # type: ignore[arg-type]


def test_dtype_auto_is_bf16_on_a_gpu_and_fp32_on_the_cpu() -> None:
    assert BackendSettings(model=Path("m")).torch_dtype == torch.float32
    assert BackendSettings(model=Path("m"), device="cuda").torch_dtype == torch.bfloat16
    assert BackendSettings(model=Path("m"), device="cuda", dtype="fp16").torch_dtype == torch.float16


def test_dtype_fastest_is_bf16_where_the_device_multiplies_it_natively() -> None:
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    on_cpu = BackendSettings(model=Path("m"), dtype="fastest").torch_dtype
    assert on_cpu == (torch.bfloat16 if native else torch.float32)
    assert BackendSettings(model=Path("m"), device="cuda", dtype="fastest").torch_dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_fp32_on_a_gpu_is_refused_in_either_mode(mode: str) -> None:
    with pytest.raises(ValidationError, match="choose --dtype bf16"):
        BackendSettings(model=Path("m"), device="cuda", dtype="fp32", kernel_mode=mode)  # type: ignore[arg-type]
    BackendSettings(model=Path("m"), device="cpu", dtype="fp32", kernel_mode=mode)  # type: ignore[arg-type]


def test_the_stack_reports_the_loaded_weights_dtype_and_mode(checkpoint: Path) -> None:
    settings = BackendSettings(
        model=checkpoint, kernel_mode="default", dtype="bf16", block_size=4, kv_split_size=8
    )
    runtime = load_runtime(settings)
    assert set(runtime.stack) == STACK_KEYS
    assert runtime.stack["weights_sha256"] == weights_sha256(checkpoint)
    assert runtime.stack["quantisation"] == "bf16"
    assert runtime.stack["kernel_mode"] == "default"
    assert runtime.stack["batching"]["kv_split_size"] == 0  # plain kernels split nothing
    assert runtime.stack["model"] == "random-qwen3"


def test_a_dense_models_stack_names_no_expert_routing(checkpoint: Path) -> None:
    runtime = load_runtime(BackendSettings(model=checkpoint, block_size=4, kv_split_size=8))
    assert "expert_routing" not in runtime.stack["batching"]
    with pytest.raises(ValueError, match="applies to mixture-of-experts models"):
        load_runtime(
            BackendSettings(model=checkpoint, block_size=4, kv_split_size=8, expert_capacity_factor=1.0)
        )


def test_a_mixture_of_experts_stack_names_its_routing(tmp_path: Path) -> None:
    folder = write_random_checkpoint(tmp_path / "random-moe", with_tokenizer=True, config=MOE_CONFIG)
    base = {"model": folder, "block_size": 4, "kv_split_size": 8}
    dropless = load_runtime(BackendSettings(**base)).stack  # type: ignore[arg-type]
    assert dropless["batching"]["expert_routing"] == {"policy": "dropless"}
    capped = load_runtime(BackendSettings(**base, expert_capacity_factor=1.25)).stack  # type: ignore[arg-type]
    assert capped["batching"]["expert_routing"] == {
        "policy": "capacity",
        "capacity_factor": 1.25,
        "overflow": "pass_through",
    }
    rerouted = load_runtime(
        BackendSettings(**base, expert_capacity_factor=1.25, expert_overflow="next_expert")  # type: ignore[arg-type]
    ).stack
    assert rerouted["batching"]["expert_routing"]["overflow"] == "next_expert"
    assert len({fingerprint(s) for s in (dropless, capped, rerouted)}) == 3
    # The kernels are batch invariant in all three; the answers only where the batch decides no token's experts.
    assert [s["kernel_mode"] for s in (dropless, capped, rerouted)] == [
        "batch_invariant",
        "batch_invariant_kernels",
        "batch_invariant_kernels",
    ]


def test_an_automatic_kv_cache_holds_a_few_whole_contexts_and_says_how_it_was_sized(checkpoint: Path) -> None:
    said: list[str] = []
    runtime = load_runtime(
        BackendSettings(model=checkpoint, block_size=4, kv_split_size=8), report=said.append
    )
    assert runtime.settings.kv_cache_mb == "auto", "the default"
    assert runtime.engine.kv_capacity_tokens >= KV_CONTEXTS * runtime.max_model_len - 4
    assert any(line.startswith("KV cache: ") and "--kv-cache-mb" in line for line in said), said


def test_the_kv_budget_sets_the_number_of_blocks(checkpoint: Path) -> None:
    settings = BackendSettings(
        model=checkpoint, model_name="named", kv_cache_mb=0.5, block_size=4, kv_split_size=8
    )
    runtime = load_runtime(settings)
    per_block = PagedKVCache.bytes_per_block(runtime.engine.model.config, 4, torch.float32)  # type: ignore[attr-defined]
    assert runtime.engine.config.num_blocks == int(0.5 * 2**20) // per_block
    assert runtime.stack["model"] == "named"


def test_a_broken_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_runtime(BackendSettings(model=tmp_path))


def test_a_gguf_stack_names_the_files_digest_its_stored_types_and_the_compute_dtype(tmp_path: Path) -> None:
    path = write_small_gguf(tmp_path / "Small-Llama.Q8_0.gguf")
    said: list[str] = []
    runtime = load_runtime(BackendSettings(model=path, block_size=4, kv_split_size=8), report=said.append)
    assert runtime.stack["weights_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert runtime.stack["quantisation"] == "gguf:F32+Q8_0->fp32"
    assert runtime.stack["model"] == "Small-Llama.Q8_0"
    assert any("dequantising to fp32" in line for line in said), said
    assert [line for line in said if not line.startswith("KV cache: ")][-1].endswith("checkpoint loaded")
    # The same file under another name on another path: the same weights, the same digest.
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    again = load_runtime(
        BackendSettings(model=copy, model_name="Small-Llama.Q8_0", block_size=4, kv_split_size=8)
    )
    assert again.stack == runtime.stack
