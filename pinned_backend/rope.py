"""Rotary position embeddings: what config.json says about them, and the cos/sin tables they give.

A config states its rotary embedding in one of two spellings: `rope_theta` with an optional `rope_scaling` object
(what checkpoints on the Hub carry), or a `rope_parameters` object (what transformers 5 writes), which for a model
with two kinds of layer (Gemma 3) holds one object per kind. Both are read into a base `theta` and an optional
`RopeScaling`: `linear` (positions slowed by a factor), `llama3` (long wavelengths slowed, a smooth band between),
`longrope` (Phi-3: a divisor per frequency, a short set within the original context and a long set beyond), and
`yarn` (gpt-oss, DeepSeek-V3, Ministral 3: interpolation blended into extrapolation by wavelength). The frequencies are
computed as Hugging Face computes them.

`rope_tables` gives cos and sin for every position, once, at load: a step then reads its rows and never recomputes
them. LongRoPE in Hugging Face picks its set by the longest sequence of the forward call, so a long prompt rotates
even its first tokens with the long set; no batch-invariant server can let one request's length decide another's
rotation, so here a position takes the long set exactly when it is at or past the original context, which is what
Hugging Face computes when a sequence is decoded one token at a time. This module knows nothing of the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pinned_backend.config_keys import CheckpointError, require

RopeKind = Literal["linear", "llama3", "longrope", "yarn"]
ROPE_KINDS: tuple[str, ...] = ("linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """A rotary scaling recipe: `kind` and the parameters it reads (the others keep their defaults)."""

    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, longrope, yarn
    kind: RopeKind = "llama3"
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per frequency
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None  # longrope, yarn: cos and sin are scaled by it; None derives it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def parse_rope(
    raw: dict[str, Any], where: str, layer_kind: str | None = None
) -> tuple[float, RopeScaling | None]:
    """The base and scaling of a config's rotary embedding; `layer_kind` names the entry of a per-kind
    `rope_parameters` object (a config without one uses its top-level keys for every kind)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and layer_kind is not None and layer_kind in params:
        params = params[layer_kind]
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"{where}: 'rope_parameters' must be an object, got {params!r}")
    if params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta_source = params if "rope_theta" in params else raw
    else:
        scaling, theta_source = raw.get("rope_scaling"), raw
    theta = require(theta_source, "rope_theta", float, where) if "rope_theta" in theta_source else 10000.0
    return theta, parse_scaling(scaling, raw, where)


def parse_scaling(raw: Any, config: dict[str, Any], where: str) -> RopeScaling | None:
    """A `rope_scaling` object (or a `rope_parameters` one without its theta); `config` supplies the top-level keys
    some recipes fall back on (Phi-3's `original_max_position_embeddings`)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: 'rope_scaling' must be an object or null, got {raw!r}")
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_KINDS:
        raise CheckpointError(
            f"{where}: rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)} or none"
        )
    sub = f"{where} rope_scaling"
    if kind == "linear":
        return RopeScaling(factor=require(raw, "factor", float, sub), kind="linear")
    if kind == "llama3":
        scaling = RopeScaling(
            factor=require(raw, "factor", float, sub),
            low_freq_factor=require(raw, "low_freq_factor", float, sub),
            high_freq_factor=require(raw, "high_freq_factor", float, sub),
            original_max_position_embeddings=require(raw, "original_max_position_embeddings", int, sub),
        )
        if scaling.high_freq_factor <= scaling.low_freq_factor:
            raise CheckpointError(f"{sub}: 'high_freq_factor' must be larger than 'low_freq_factor'")
        return scaling
    original_key = "original_max_position_embeddings"
    original = require(raw if original_key in raw else config, original_key, int, sub)
    if kind == "longrope":
        return _parse_longrope(raw, config, original, sub)
    return RopeScaling(
        factor=require(raw, "factor", float, sub),
        original_max_position_embeddings=original,
        kind="yarn",
        attention_factor=_number(raw, "attention_factor", sub),
        beta_fast=_number(raw, "beta_fast", sub) or 32.0,
        beta_slow=_number(raw, "beta_slow", sub) or 1.0,
        mscale=_number(raw, "mscale", sub),
        mscale_all_dim=_number(raw, "mscale_all_dim", sub),
        truncate=raw.get("truncate", True) is not False,
    )


def _parse_longrope(raw: dict[str, Any], config: dict[str, Any], original: int, where: str) -> RopeScaling:
    factors = []
    for key in ("short_factor", "long_factor"):
        value = raw.get(key)
        if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
            for v in value
        ):
            raise CheckpointError(f"{where}: {key!r} must be a list of positive numbers")
        factors.append(tuple(float(v) for v in value))
    factor = _number(raw, "factor", where)
    if factor is None:
        factor = require(config, "max_position_embeddings", int, where) / original
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        kind="longrope",
        short_factor=factors[0],
        long_factor=factors[1],
        attention_factor=_number(raw, "attention_factor", where),
    )


def _number(raw: dict[str, Any], key: str, where: str) -> float | None:
    return None if raw.get(key) is None else require(raw, key, float, where)


def check_scaling(scaling: RopeScaling | None, rotary_dim: int, where: str) -> None:
    """A LongRoPE recipe needs one divisor per frequency of the rotated dimensions."""
    if scaling is not None and scaling.kind == "longrope":
        for name, factors in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
            if len(factors) != rotary_dim // 2:
                raise CheckpointError(
                    f"{where}: rope_scaling {name!r} has {len(factors)} numbers; the head's {rotary_dim} "
                    f"rotated dimensions need {rotary_dim // 2}"
                )


def inv_freq(theta: float, scaling: RopeScaling | None, dim: int, *, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies [dim / 2] in float32, computed as Hugging Face computes them; `long`: LongRoPE's
    set for positions past the original context."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if scaling is None:
        return 1.0 / (theta**exponents)
    if scaling.kind == "linear":
        return 1.0 / (theta**exponents) / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(1.0 / (theta**exponents), scaling)
    if scaling.kind == "longrope":
        divisors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        return 1.0 / (divisors * theta**exponents)
    return _yarn(theta, scaling, dim)


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor on cos and sin (and so on every q.k twice over) that LongRoPE and YaRN apply."""
    if scaling is None or scaling.kind in ("linear", "llama3"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    return yarn_mscale(factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(
    theta: float,
    scaling: RopeScaling | None,
    dim: int,
    positions: int,
    freq_factors: tuple[float, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, dim / 2] float32 for every position, scaled by the recipe's attention factor.
    `freq_factors`: one divisor per frequency, as GGUF files carry Llama 3.x scaling."""
    freqs = inv_freq(theta, scaling, dim)
    if freq_factors is not None:
        freqs = freqs / torch.tensor(freq_factors, dtype=torch.float32)
    angles = torch.arange(positions).float()[:, None] * freqs[None, :]
    if scaling is not None and scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        long = torch.arange(positions).float()[:, None] * inv_freq(theta, scaling, dim, long=True)[None, :]
        angles = torch.where(torch.arange(positions)[:, None] >= original, long, angles)
    factor = attention_factor(scaling)
    return angles.cos() * factor, angles.sin() * factor


def _llama3(freqs: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / s.factor, freqs)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(theta: float, s: RopeScaling, dim: int) -> torch.Tensor:
    # Frequencies that turn many times within the original context keep their speed (extrapolation); those that
    # turn less than once are slowed by `factor` (interpolation); a linear ramp over the dimensions blends the two.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as Hugging Face avoids the singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
