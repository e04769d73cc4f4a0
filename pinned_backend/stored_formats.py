"""Weights stored quantised in a Hugging Face folder, read back to floats: gpt-oss's MXFP4 experts and DeepSeek-V3's
FP8 blocks.

A folder whose config.json has a `quantization_config` stores some tensors packed, under names of their own:
- `mxfp4` (gpt-oss): an expert tensor `X` as `X_blocks` [..., rows, K / 32, 16] uint8 (two 4-bit E2M1 values a byte,
  the low nibble first) and `X_scales` [..., rows, K / 32] uint8 (a power of two per 32 values, biased by 127). The
  values decode as Hugging Face decodes them (transformers' `convert_moe_packed_tensors`), to [..., rows, K], which
  is the transpose of how transformers lays the expert out; it is returned in that layout.
- `fp8` (DeepSeek-V3): a weight `X.weight` as float8 (e4m3) with `X.weight_scale_inv` float32, one scale per block of
  `weight_block_size` (128 x 128): the weight is the stored values times their block's scale.
The stack names the stored format (`quantisation`, e.g. `mxfp4->bf16`): the answers are those of the dequantised
weights in the compute dtype. This module knows nothing of which tensors a model needs beyond their names.
"""

from __future__ import annotations

from typing import Any

import torch

from pinned_backend.config_keys import CheckpointError

QUANT_METHODS = ("mxfp4", "fp8")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES, _SCALE_INV = "_blocks", "_scales", ".weight_scale_inv"


def quant_method(raw: dict[str, Any], where: str) -> str | None:
    """The stored format a config.json declares (`quantization_config.quant_method`), None where it declares none;
    a format not read here is an error naming it."""
    spec = raw.get("quantization_config")
    if spec is None:
        return None
    method = spec.get("quant_method") if isinstance(spec, dict) else None
    if method not in QUANT_METHODS:
        raise CheckpointError(
            f"{where}: quantization_config quant_method {method!r} is not supported; supported: "
            f"{', '.join(QUANT_METHODS)} (or unquantised weights)"
        )
    if method == "fp8" and spec.get("weight_block_size", [128, 128]) != [128, 128]:
        raise CheckpointError(
            f"{where}: fp8 weight_block_size {spec['weight_block_size']!r}; only [128, 128] is read"
        )
    return str(method)


def is_packed(name: str) -> bool:
    """Whether `name` is a part of a packed tensor (MXFP4 blocks or scales, an FP8 scale)."""
    return name.endswith((_BLOCKS, _SCALES, _SCALE_INV))


def unpack(
    stored: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str
) -> dict[str, torch.Tensor]:
    """Every packed tensor of `stored` decoded to float32 under the name `expected` gives it, checked for shape.
    FP8 weights arrive in `stored` under their own names, beside their scales."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(stored):
        if name.endswith(_BLOCKS):
            base = name.removesuffix(_BLOCKS)
            scales = stored.get(base + _SCALES)
            if scales is None:
                raise CheckpointError(f"{where}: {name!r} has no {base + _SCALES!r} beside it")
            out[base] = mxfp4_decode(stored[name], scales).transpose(-1, -2)
        elif name.endswith(_SCALE_INV):
            base = name.removesuffix("_scale_inv")
            if base not in stored:
                raise CheckpointError(f"{where}: {name!r} has no {base!r} beside it")
            out[base] = fp8_decode(stored[base], stored[name])
        elif name.endswith(_SCALES) and name.removesuffix(_SCALES) + _BLOCKS not in stored:
            raise CheckpointError(f"{where}: {name!r} has no blocks beside it")
    for name, tensor in out.items():
        if name not in expected:
            raise CheckpointError(f"{where}: unexpected packed tensor {name!r} for this config.json")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{where}: packed tensor {name!r} decodes to shape {tuple(tensor.shape)}, config.json implies "
                f"{expected[name]}"
            )
    return out


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8, scales [..., rows, G] uint8 -> [..., rows, G * 32] float32."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} {scales.dtype} "
            "do not fit: blocks must be [..., G, 16] uint8 and scales [..., G] uint8"
        )
    lut = torch.tensor(_FP4_VALUES, dtype=torch.float32)
    values = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=torch.float32)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)


def fp8_decode(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """weight [N, K] float8, scale_inv [ceil(N / block), ceil(K / block)] -> [N, K] float32."""
    n, k = weight.shape
    if scale_inv.shape != (-(-n // block), -(-k // block)):
        raise CheckpointError(
            f"an FP8 weight of shape {(n, k)} needs scales of shape {(-(-n // block), -(-k // block))}, "
            f"got {tuple(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return weight.float() * scales
