"""The backend's description of its own stack (schema 2 of docs/protocol.md) and its fingerprint.

The object is built from what the process really loaded and runs on: the digest of the weight files it read,
the dtype it computes in, the device it found, the kernel mode it selected, the versions of the libraries it
imported with this package's own source digest, the batching policy its engine enforces, and how it pools an
embedding. Building and
hashing are pure functions of explicit inputs; the two `detect_*` functions are the only ones that look at the
machine (and at the package's source), and they do it once at start.

This module leaves loading weights, choosing kernels and serving HTTP to others.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import rfc8785
import torch

import pinned_backend
from pinned_backend.digests import files_sha256
from pinned_backend.grammar import engine_version as grammar_engine_version

SCHEMA = 2
# llguidance is the grammar engine: another version may allow other tokens under one grammar.
SOFTWARE_KEYS = ("backend", "torch", "cuda", "triton", "driver", "llguidance")
STACK_KEYS = frozenset(
    {
        "schema",
        "model",
        "weights_sha256",
        "quantisation",
        "hardware",
        "hardware_detail",
        "kernel_mode",
        "software",
        "batching",
        "embedding",
    }
)
POOLINGS = ("last_token", "mean")
DTYPE_NAMES: Mapping[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}

# Most capable first: the first flag a CPU has names its vector ISA.
# Native bf16 dot products (AVX-512 BF16, AMX) are named apart: a bf16 weight then goes through oneDNN's kernels for
# them (kernels/onednn.py), elsewhere through the BLAS, and the two give other bits.
_X86_ISAS = (
    ("amx_bf16", "amx"),
    ("avx512_bf16", "avx512-bf16"),
    ("avx512f", "avx512"),
    ("avx2", "avx2"),
    ("avx", "avx"),
    ("sse4_2", "sse4"),
    ("sse2", "sse2"),
)
_ARM_ISAS = (("sve2", "sve2"), ("sve", "sve"), ("asimd", "neon"))


# What the stack's kernel_mode says of a backend whose kernels are batch invariant but whose routing is not (a
# mixture-of-experts model with a capacity factor: the rest of the batch decides a token's experts). Its answers
# depend on the batch, so it must not say `batch_invariant`, which a pin takes as that promise (invariant 8).
INVARIANT_KERNELS_ONLY = "batch_invariant_kernels"

# Keys of the batching policy that say how the backend computes, never what: under batch-invariant kernels neither
# changes a bit of any answer (tests/test_invariance.py), so replicas that differ only in them serve one stack.
UNFINGERPRINTED_BATCHING = ("prefix_cache", "speculation", "tensor_parallel")


def fingerprint(stack: Mapping[str, Any]) -> str:
    """SHA-256 of the RFC 8785 canonical JSON of `stack` without the batching keys that change no bit, lowercase
    hex."""
    return hashlib.sha256(rfc8785.dumps(fingerprinted(stack))).hexdigest()


def fingerprinted(stack: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a stack its fingerprint covers: all of it but `UNFINGERPRINTED_BATCHING`."""
    out = dict(stack)
    if isinstance(out.get("batching"), Mapping):
        out["batching"] = {k: v for k, v in out["batching"].items() if k not in UNFINGERPRINTED_BATCHING}
    return out


def cpu_hardware(cpuinfo: str, machine: str) -> tuple[str, dict[str, Any]]:
    """The hardware generation and detail of a CPU, from /proc/cpuinfo's text and `platform.machine()`."""
    model: str | None = None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and model is None and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    arch = machine.lower() or "unknown"
    table = _ARM_ISAS if arch in ("aarch64", "arm64") else _X86_ISAS
    isa = next((name for flag, name in table if flag in flags), "generic")
    return f"cpu-{arch}-{isa}", {"cpu_model": model, "isa": isa}


def gpu_hardware(name: str, compute_capability: tuple[int, int]) -> tuple[str, dict[str, Any]]:
    """The hardware generation and detail of a GPU from its reported name: `NVIDIA H200` -> `nvidia-h200`."""
    generation = "-".join(name.lower().split())
    major, minor = compute_capability
    return generation, {"name": name, "compute_capability": f"{major}.{minor}"}


def batching_policy(
    max_batch_size: int,
    max_step_tokens: int,
    kv_split_size: int,
    expert_routing: Mapping[str, Any] | None = None,
    *,
    prefix_cache: bool = False,
    speculative_tokens: int = 0,
    tensor_parallel: int | None = None,
    reduction_tree: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`expert_routing`: a mixture-of-experts model's routing (`ExpertRouting.describe()`), None for a dense model,
    whose stack then has no such key: a capacity factor makes what the batch holds change a token's experts.
    `prefix_cache` and `speculative_tokens` (0: off) name serving features outside the fingerprint.
    `tensor_parallel`: the degree a model is cut at, outside the fingerprint under batch_invariant kernels, whose
    `reduction_tree` (the fixed chunks every degree sums row-parallel products over) is inside it; both absent
    from a model served whole in one process."""
    speculation = None
    if speculative_tokens:
        speculation = {"method": "prompt_lookup", "draft_tokens": speculative_tokens}
    policy: dict[str, Any] = {
        "policy": "continuous",
        "max_batch_size": max_batch_size,
        "max_step_tokens": max_step_tokens,
        "kv_split_size": kv_split_size,
        "prefix_cache": prefix_cache,
        "speculation": speculation,
    }
    if expert_routing is not None:
        policy["expert_routing"] = dict(expert_routing)
    if tensor_parallel is not None:
        policy["tensor_parallel"] = tensor_parallel
        policy["reduction_tree"] = dict(reduction_tree or {})
    return policy


def embedding_method(pooling: str) -> dict[str, Any]:
    """How `/v1/embeddings` turns a sequence's final hidden states into one vector: the last token's, or their mean
    over the sequence, then scaled to unit L2 norm."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, not {pooling!r}")
    return {"pooling": pooling, "normalized": True}


def build_stack(
    *,
    model: str,
    weights_sha256: str | None,
    quantisation: str,
    hardware: tuple[str, dict[str, Any]],
    kernel_mode: str,
    software: Mapping[str, str | None],
    batching: Mapping[str, Any],
    embedding: Mapping[str, Any],
) -> dict[str, Any]:
    """The schema-2 stack object: every key present, unknown values null. `kernel_mode` is the kernels' mode; the
    stack says `batch_invariant` only when the answers are, never under capacity-limited routing."""
    generation, detail = hardware
    routing = batching.get("expert_routing") or {}
    if kernel_mode == "batch_invariant" and routing.get("policy") == "capacity":
        kernel_mode = INVARIANT_KERNELS_ONLY
    return {
        "schema": SCHEMA,
        "model": model,
        "weights_sha256": weights_sha256,
        "quantisation": quantisation,
        "hardware": generation,
        "hardware_detail": dict(detail),
        "kernel_mode": kernel_mode,
        "software": {key: software.get(key) for key in SOFTWARE_KEYS},
        "batching": dict(batching),
        "embedding": dict(embedding),
    }


def detect_hardware(device: torch.device) -> tuple[str, dict[str, Any]]:
    """The hardware the process computes on: the CUDA device it uses, or this machine's CPU."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return gpu_hardware(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    generation, detail = cpu_hardware(cpuinfo, platform.machine())
    # On a CPU the thread count changes how a GEMM's sums are split, so it changes answers: it is part of the stack.
    return generation, {**detail, "threads": torch.get_num_threads()}


def detect_software(device: torch.device) -> dict[str, str | None]:
    """Versions of what the process runs: this package (with a digest of its source), torch, on a GPU CUDA, Triton
    and the driver, and the grammar engine that constrained outputs go through."""
    on_gpu = device.type == "cuda"
    return {
        "backend": backend_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if on_gpu else None,
        "triton": _distribution_version("triton") if on_gpu else None,
        "driver": _nvidia_driver_version() if on_gpu else None,
        "llguidance": grammar_engine_version(),
    }


def backend_version(version: str = pinned_backend.__version__) -> str:
    """This package's version and the first 12 hex digits of its source digest, as `0.1.0+src.0123456789ab`.

    The source decides every reduction order (the kernels, their tile plans, the model's order of operations), so
    two builds whose source differs must not share a stack, whatever their version number says: a tile plan tuned
    anew on the same version would otherwise let one fingerprint stand for two sets of answers. The version is the
    one the source itself declares (`pinned_backend.__version__`, which the source digest covers), never an
    installer's metadata: a source tree run in place, installed, or installed in editable mode and edited since
    is one source, so it names one stack."""
    digest = source_sha256(Path(__file__).resolve().parent)[:12]
    # A version that already has a local part (`0.1.0+g1234`) takes the digest as one more segment of it.
    return f"{version}{'.' if '+' in version else '+'}src.{digest}"


# The source files a digest covers: the Python and the C kernels compiled at first use (kernels.native).
SOURCE_SUFFIXES = (".py", ".c")


def source_sha256(package: Path) -> str:
    """SHA-256 over each `*.py` and `*.c` file's own SHA-256 under `package`, as `path:hex\\n` lines in path order (paths
    relative to `package`, `/`-separated, sorted by code point), as `weights_sha256` digests weight files. Hidden
    files and folders (editor and notebook copies) and anything that is not a regular file are left out."""
    files = sorted(
        (
            path
            for path in package.rglob("*")
            if path.suffix in SOURCE_SUFFIXES
            and path.is_file()
            and not any(part.startswith(".") for part in path.relative_to(package).parts)
        ),
        key=lambda path: path.relative_to(package).as_posix(),
    )
    if not files:
        # An install without its source (bytecode only, or a zip) would otherwise give every build one digest.
        raise RuntimeError(f"{package}: no Python source to digest; the backend's stack must name its source")
    return files_sha256((path.relative_to(package).as_posix(), path) for path in files)


def _distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_driver_version() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
    for word in text.split():
        parts = word.split(".")
        if len(parts) >= 2 and all(p.isdigit() for p in parts):
            return word
    return None
