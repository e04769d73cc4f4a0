"""Specification of pinned_backend.stack: the schema-2 object, its fingerprint, and hardware detection."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinned_backend
from pinned_backend.stack import (
    STACK_KEYS,
    UNFINGERPRINTED_BATCHING,
    backend_version,
    batching_policy,
    build_stack,
    cpu_hardware,
    detect_hardware,
    detect_software,
    embedding_method,
    fingerprint,
    fingerprinted,
    gpu_hardware,
    source_sha256,
)

X86_CPUINFO = """processor	: 0
vendor_id	: GenuineIntel
model name	: Intel(R) Xeon(R) Processor @ 2.80GHz
flags		: fpu sse2 sse4_2 avx avx2 avx512f avx512bw
"""
ARM_CPUINFO = """processor	: 0
Features	: fp asimd evtstrm aes crc32
CPU implementer	: 0x41
"""


def _stack(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "model": "tiny",
        "weights_sha256": "ab" * 32,
        "quantisation": "fp32",
        "hardware": cpu_hardware(X86_CPUINFO, "x86_64"),
        "kernel_mode": "batch_invariant",
        "software": {"backend": "0.1.0", "torch": "2.13.0"},
        "batching": batching_policy(16, 256, 64),
        "embedding": embedding_method("last_token"),
    }
    return build_stack(**{**fields, **overrides})


def test_stack_has_exactly_the_schema_keys_and_nulls_for_unknowns() -> None:
    stack = _stack()
    assert set(stack) == STACK_KEYS
    assert stack["schema"] == 2
    assert stack["embedding"] == {"pooling": "last_token", "normalized": True}
    assert stack["software"] == {
        "backend": "0.1.0",
        "torch": "2.13.0",
        "cuda": None,
        "triton": None,
        "driver": None,
        "llguidance": None,
    }
    assert stack["batching"] == {
        "policy": "continuous",
        "max_batch_size": 16,
        "max_step_tokens": 256,
        "kv_split_size": 64,
        "prefix_cache": False,
        "speculation": None,
    }


def test_the_batching_policy_says_which_serving_features_run() -> None:
    policy = batching_policy(16, 256, 64, prefix_cache=True, speculative_tokens=4)
    assert policy["prefix_cache"] is True
    assert policy["speculation"] == {"method": "prompt_lookup", "draft_tokens": 4}


def test_fingerprint_is_sha256_of_canonical_json_without_the_features_that_change_no_bit() -> None:
    stack = _stack(batching=batching_policy(16, 256, 64, prefix_cache=True, speculative_tokens=4))
    covered = {
        **stack,
        "batching": {k: v for k, v in stack["batching"].items() if k not in UNFINGERPRINTED_BATCHING},
    }
    assert set(stack["batching"]) - set(covered["batching"]) == {"prefix_cache", "speculation"}
    assert fingerprinted(stack) == covered
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert fingerprint(stack) == hashlib.sha256(canonical).hexdigest()
    assert fingerprint(stack) == fingerprint(_stack()), (
        "a replica with the features off serves the same stack"
    )


def _shuffled(value: Any, rnd: st.DataObject) -> Any:
    if isinstance(value, dict):
        keys = rnd.draw(st.permutations(list(value)))
        return {k: _shuffled(value[k], rnd) for k in keys}
    return value


@given(data=st.data())
@settings(max_examples=50, deadline=None)
def test_fingerprint_is_stable_across_key_order(data: st.DataObject) -> None:
    stack = _stack(model=data.draw(st.text(max_size=20)))
    assert fingerprint(_shuffled(stack, data)) == fingerprint(stack)


def test_fingerprint_changes_with_any_field() -> None:
    base = fingerprint(_stack())
    assert fingerprint(_stack(kernel_mode="default")) != base
    assert fingerprint(_stack(quantisation="bf16")) != base
    assert fingerprint(_stack(batching=batching_policy(8, 256, 64))) != base


def test_a_capacity_limited_moe_never_claims_batch_invariant_answers() -> None:
    capped = batching_policy(
        16, 256, 64, {"policy": "capacity", "capacity_factor": 1.0, "overflow": "pass_through"}
    )
    dropless = batching_policy(16, 256, 64, {"policy": "dropless"})
    # Its kernels are invariant, its routing is not: which experts a token gets depends on the rest of the batch.
    assert _stack(batching=capped)["kernel_mode"] == "batch_invariant_kernels"
    assert _stack(batching=dropless)["kernel_mode"] == "batch_invariant"
    assert _stack(batching=capped, kernel_mode="default")["kernel_mode"] == "default"
    assert fingerprint(_stack(batching=capped)) != fingerprint(_stack(batching=dropless))


def test_cpu_hardware_names_the_best_vector_isa() -> None:
    assert cpu_hardware(X86_CPUINFO, "x86_64") == (
        "cpu-x86_64-avx512",
        {"cpu_model": "Intel(R) Xeon(R) Processor @ 2.80GHz", "isa": "avx512"},
    )
    assert cpu_hardware(X86_CPUINFO.replace(" avx512f avx512bw", ""), "x86_64")[0] == "cpu-x86_64-avx2"
    # Native bf16 dot products change which kernels a bf16 weight takes, so they name a generation of their own.
    with_bf16 = X86_CPUINFO.replace("avx512bw", "avx512bw avx512_bf16")
    assert cpu_hardware(with_bf16, "x86_64")[0] == "cpu-x86_64-avx512-bf16"
    assert (
        cpu_hardware(with_bf16.replace("avx512_bf16", "avx512_bf16 amx_bf16 amx_tile"), "x86_64")[0]
        == "cpu-x86_64-amx"
    )
    assert cpu_hardware(ARM_CPUINFO, "aarch64") == ("cpu-aarch64-neon", {"cpu_model": None, "isa": "neon"})
    assert cpu_hardware("", "riscv64")[0] == "cpu-riscv64-generic"


def test_gpu_hardware_lowercases_the_name() -> None:
    assert gpu_hardware("NVIDIA H200", (9, 0)) == (
        "nvidia-h200",
        {"name": "NVIDIA H200", "compute_capability": "9.0"},
    )
    assert gpu_hardware("NVIDIA A100-SXM4-80GB", (8, 0))[0] == "nvidia-a100-sxm4-80gb"


def test_detection_reports_this_machine() -> None:
    hardware, detail = detect_hardware(torch.device("cpu"))
    assert hardware.startswith("cpu-")
    assert set(detail) == {"cpu_model", "isa", "threads"}
    assert detail["threads"] == torch.get_num_threads(), (
        "the thread count changes CPU answers: it is in the stack"
    )
    software = detect_software(torch.device("cpu"))
    assert software["torch"] == torch.__version__
    assert software["backend"] == backend_version()
    assert software["cuda"] is None
    assert software["llguidance"] == importlib.metadata.version("llguidance"), (
        "the grammar engine decides which tokens a constrained answer may take: the stack names its version"
    )


def test_the_backend_names_the_version_its_source_declares_and_the_digest_of_that_source() -> None:
    package = Path(pinned_backend.__file__).parent
    digest = source_sha256(package)[:12]
    assert re.fullmatch(r"[0-9a-f]{12}", digest)
    assert backend_version() == f"{pinned_backend.__version__}+src.{digest}"
    # A version with a local part of its own keeps one `+`: the digest becomes one more segment of it.
    assert backend_version("0.2.0+g1234") == f"0.2.0+g1234.src.{digest}"
    # The installed distribution's version is the source's own, so an install names the same stack.
    assert importlib.metadata.version("stackpin") == pinned_backend.__version__


def test_one_source_names_one_stack_however_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = backend_version()

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    # Run from a source tree no installer has seen, or under an editable install's stale metadata: one version.
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert backend_version() == installed
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    assert backend_version() == installed


def test_any_change_to_the_source_changes_its_digest_and_nothing_else_does(tmp_path: Path) -> None:
    # Two builds of one version whose kernels differ may differ in every answer: their stacks must differ too.
    package = tmp_path / "pinned_backend"
    shutil.copytree(
        Path(pinned_backend.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__")
    )
    digest = source_sha256(package)
    assert digest == source_sha256(Path(pinned_backend.__file__).parent)
    (package / "kernels" / "notes.txt").write_text("not source")
    (package / "__pycache__").mkdir(exist_ok=True)
    (package / "__pycache__" / "stack.cpython-311.pyc").write_bytes(b"compiled")
    (package / ".ipynb_checkpoints").mkdir()
    (package / ".ipynb_checkpoints" / "model-checkpoint.py").write_text("a notebook's copy")
    (package / ".#model.py").symlink_to(package / "no-such-file")  # an editor's lock, dangling
    assert source_sha256(package) == digest, "only the package's own source counts"
    kernel = package / "kernels" / "cpu_paged_attention.c"
    kernel.write_text(kernel.read_text().replace("#define TILE_QUERIES 48", "#define TILE_QUERIES 47"))
    assert source_sha256(package) != digest, "the compiled kernels' C source counts too"
    kernel.write_text(kernel.read_text().replace("#define TILE_QUERIES 47", "#define TILE_QUERIES 48"))
    plans = package / "kernels" / "triton" / "matmul_plans.py"
    plans.write_text(plans.read_text().replace("LARGE_M = 1 << 62", "LARGE_M = 1 << 61"))
    changed = source_sha256(package)
    assert changed != digest
    plans.rename(package / "kernels" / "triton" / "matmul_plans_renamed.py")
    assert source_sha256(package) not in (digest, changed), "a file's path counts as well as its bytes"


def test_a_package_without_its_source_is_refused_rather_than_given_a_digest_of_nothing(
    tmp_path: Path,
) -> None:
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "stack.cpython-311.pyc").write_bytes(b"compiled")
    with pytest.raises(RuntimeError, match="no Python source to digest"):
        source_sha256(tmp_path)
