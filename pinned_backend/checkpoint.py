"""Reading a Hugging Face checkpoint folder: its config, its weight tensors and the digest of its weight
files.

A folder holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json`. This module reads `config.json` (families.py turns it into a frozen `ModelConfig`),
loads the tensors by their Hugging Face names with the shapes that config implies (layout.py), decoding those stored
packed (stored_formats.py), and computes `weights_sha256` exactly as docs/protocol.md defines it. Every problem with
the folder is a `CheckpointError` that names the file and what is wrong with it. It knows nothing of how the tensors
are arranged for the forward pass (model.py) or of tokenizers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pinned_backend.config_keys import CheckpointError as CheckpointError
from pinned_backend.digests import files_sha256
from pinned_backend.families import CONFIG_FILE as CONFIG_FILE
from pinned_backend.families import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from pinned_backend.families import parse_config as parse_config
from pinned_backend.layout import expected_shapes as expected_shapes
from pinned_backend.layout import expert_names as expert_names
from pinned_backend.model_config import MlaConfig as MlaConfig
from pinned_backend.model_config import ModelConfig as ModelConfig
from pinned_backend.model_config import MoeConfig as MoeConfig
from pinned_backend.rope import RopeScaling as RopeScaling
from pinned_backend.stored_formats import is_packed, quant_method, unpack

SINGLE_WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Tensors some exporters add that carry nothing the forward pass needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


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


def stored_quantisation(folder: Path) -> str | None:
    """The packed format config.json declares for some of the folder's tensors (`mxfp4`, `fp8`), or None."""
    path = folder / CONFIG_FILE
    raw = read_json(path)
    return quant_method(raw, str(path)) if isinstance(raw, dict) else None


def ignored_layers(config: ModelConfig) -> range:
    """Layers a checkpoint may carry that the forward pass does not run: DeepSeek-V3's multi-token prediction
    layers, after the last (they propose drafts for speculative decoding; the backend drafts by prompt lookup)."""
    extra = config.mla.mtp_layers if config.mla is not None else 0
    return range(config.num_hidden_layers, config.num_hidden_layers + extra)


def load_weights(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Load every tensor `expected_shapes` names, checked for shape, converted to `dtype`, on the CPU; packed ones
    decoded first."""
    expected = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
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
                    if _skipped(name, config):
                        continue
                    if name in tensors or name in packed:
                        raise CheckpointError(f"{path}: tensor {name!r} appears in more than one weight file")
                    tensor = handle.get_tensor(name)
                    if is_packed(name) or tensor.dtype in _FP8:
                        packed[name] = tensor
                        continue
                    if name not in expected:
                        raise CheckpointError(f"{path}: unexpected tensor {name!r} for this config.json")
                    tensors[name] = _checked(tensor, expected[name], name, path).to(dtype)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    for name, tensor in unpack(packed, expected, str(folder)).items():
        if name in tensors:
            raise CheckpointError(f"{folder}: tensor {name!r} is stored both packed and unpacked")
        tensors[name] = tensor.to(dtype)
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: weight files lack {len(missing)} tensor(s), first {missing[0]!r}")
    return tensors


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _skipped(name: str, config: ModelConfig) -> bool:
    if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
        return True
    layer = _LAYER.match(name)
    return layer is not None and int(layer.group(1)) in ignored_layers(config)


def _checked(tensor: torch.Tensor, shape: tuple[int, ...], name: str, path: Path) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {shape}"
        )
    if not tensor.is_floating_point():
        raise CheckpointError(f"{path}: tensor {name!r} has non-float dtype {tensor.dtype}")
    return tensor


def weights_sha256(folder: Path) -> str:
    """SHA-256 over each `*.safetensors` file's own SHA-256, in file-name order, as `name:hex\\n` lines."""
    files = sorted(folder.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files to digest")
    return files_sha256((path.name, path) for path in files)
