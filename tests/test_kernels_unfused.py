"""Specification of the fused families unfused (`kernels.unfused`): each is exactly the plain torch ops it stands
for, bit for bit, on the kernel set's own `rms_norm`, in both CPU kernel sets, whether their compiled per-row ops
(kernels.cpu_layer_ops) serve or the torch ops; and in batch_invariant mode a row's bits do not depend on the rows
around it."""

from __future__ import annotations

import pytest
import torch

from pinned_backend.kernels.cpu_default import TorchKernels
from pinned_backend.kernels.cpu_invariant import CpuInvariantKernels
from pinned_backend.kernels.unfused import (
    UnfusedKernels,
    clamped_swiglu,
    gelu_tanh,
    sigmoid,
    softcap,
)

DTYPES = [torch.float32, torch.bfloat16]
KERNEL_SETS = {"default": TorchKernels, "batch_invariant": CpuInvariantKernels}
HQ, HKV, D, PAGE, BLOCKS = 4, 2, 32, 4, 6
EPS = 1e-6


def randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.fixture(
    params=[(name, compiled) for name in KERNEL_SETS for compiled in (True, False)],
    ids=lambda param: f"{param[0]}-{'compiled' if param[1] else 'torch-ops'}",
)
def kernels(request: pytest.FixtureRequest) -> UnfusedKernels:
    """Each CPU set with its compiled per-row ops, and with the torch ops that serve where none builds."""
    name, compiled = request.param
    made: UnfusedKernels = KERNEL_SETS[name](compiled=compiled)
    return made


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_torchs_add_then_the_sets_own_rms_norm(
    kernels: UnfusedKernels, dtype: torch.dtype
) -> None:
    x, delta = randn(9, 64, seed=1, dtype=dtype, scale=3), randn(9, 64, seed=2, dtype=dtype)
    weight = randn(64, seed=3, dtype=dtype)
    summed, normed = kernels.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, kernels.rms_norm(x + delta, weight, EPS))
    for row in (0, 4, 8):
        alone = kernels.add_rms_norm(x[row : row + 1], delta[row : row + 1], weight, EPS)
        assert torch.equal(alone[0], summed[row : row + 1]) and torch.equal(alone[1], normed[row : row + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_rounds_silu_to_the_dtype_then_multiplies(
    kernels: UnfusedKernels, dtype: torch.dtype
) -> None:
    gate_up = randn(7, 2 * 100, seed=4, dtype=dtype, scale=5)
    gate, up = gate_up[:, :100], gate_up[:, 100:]
    g32 = gate.float()
    expected = (g32 / (1 + torch.exp(-g32))).to(dtype) * up
    out = kernels.silu_mul(gate_up)
    assert out.shape == (7, 100) and out.dtype == dtype
    assert torch.equal(out, expected)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, atol=tolerance, rtol=tolerance)
    assert torch.equal(kernels.silu_mul(gate_up[3:4]), out[3:4])


def unfused_qkv(
    kernels: UnfusedKernels,
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """Split, per-head norm, Hugging Face's rotate_half RoPE in float32, and a plain indexed cache write."""
    t = qkv.shape[0]
    q, k, v = qkv[:, : HQ * D], qkv[:, HQ * D : (HQ + HKV) * D], qkv[:, (HQ + HKV) * D :]
    q, k, v = q.reshape(t, HQ, D), k.reshape(t, HKV, D), v.reshape(t, HKV, D)
    if q_norm is not None and k_norm is not None:
        q = kernels.rms_norm(q.reshape(t * HQ, D), q_norm, EPS).reshape(t, HQ, D)
        k = kernels.rms_norm(k.reshape(t * HKV, D), k_norm, EPS).reshape(t, HKV, D)
    cos = torch.cat([cos_table[positions]] * 2, dim=-1)[:, None]  # [T, 1, D]
    sin = torch.cat([sin_table[positions]] * 2, dim=-1)[:, None]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        rotated = torch.cat([-x32[..., D // 2 :], x32[..., : D // 2]], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)

    q, k = rotate(q), rotate(k)
    for slot, key, value in zip(slots.tolist(), k, v, strict=True):
        k_cache[slot // PAGE, slot % PAGE] = key
        v_cache[slot // PAGE, slot % PAGE] = value
    return q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qkv_rope_cache_is_split_norm_rope_and_a_write_of_exactly_its_slots(
    kernels: UnfusedKernels, dtype: torch.dtype, qk_norm: bool
) -> None:
    t, max_positions = 11, 64
    qkv = randn(t, (HQ + 2 * HKV) * D, seed=5, dtype=dtype, scale=2)
    q_norm = randn(D, seed=6, dtype=dtype).abs() + 0.5 if qk_norm else None
    k_norm = randn(D, seed=7, dtype=dtype).abs() + 0.5 if qk_norm else None
    angles = torch.arange(max_positions).float()[:, None] * torch.rand(
        D // 2, generator=torch.Generator().manual_seed(10)
    )
    cos, sin = angles.cos(), angles.sin()
    positions = torch.randint(0, max_positions, (t,), generator=torch.Generator().manual_seed(8))
    slots = torch.randperm(BLOCKS * PAGE, generator=torch.Generator().manual_seed(9))[:t]

    caches = [torch.full((BLOCKS, PAGE, HKV, D), float("nan"), dtype=dtype) for _ in range(4)]
    q = kernels.qkv_rope_cache(qkv, q_norm, k_norm, EPS, cos, sin, positions, slots, caches[0], caches[1])
    expected = unfused_qkv(kernels, qkv, q_norm, k_norm, cos, sin, positions, slots, caches[2], caches[3])
    assert q.shape == (t, HQ, D) and q.dtype == dtype
    assert torch.equal(q, expected)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        # NaN marks every slot that must stay unwritten; equal_nan makes them compare equal.
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    written = ~caches[0].isnan().flatten(2).all(-1).flatten()
    assert sorted(torch.nonzero(written).flatten().tolist()) == sorted(slots.tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_is_torchs_tanh_gelu_rounded_to_the_dtype_then_multiplied(
    kernels: UnfusedKernels, dtype: torch.dtype
) -> None:
    gate_up = randn(7, 96, seed=11, dtype=dtype, scale=4)
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels.gelu_mul(gate_up)
    expected = torch.nn.functional.gelu(gate.float(), approximate="tanh")
    torch.testing.assert_close(out, (expected.to(dtype) * up), atol=1e-5, rtol=1e-2)
    assert torch.equal(out[3:4], kernels.gelu_mul(gate_up[3:4]))


def _swiglu_of(x: torch.Tensor) -> torch.Tensor:
    # Gate x, up x / 2: an elementwise function of x.
    return clamped_swiglu(torch.cat([x, x * 0.5])[None], 1.702, 7.0)[0]


def _swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.clamp(max=7.0), (x * 0.5).clamp(-7.0, 7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


ACTIVATIONS = {
    "gelu_tanh": (gelu_tanh, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "sigmoid": (sigmoid, torch.sigmoid),
    "softcap": (lambda x: softcap(x.float(), 2.5), lambda x: torch.tanh(x / 2.5) * 2.5),
    "clamped_swiglu": (_swiglu_of, _swiglu_reference),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_spelled_out_activations_give_an_element_the_same_bits_wherever_it_sits(
    name: str, dtype: torch.dtype
) -> None:
    # PyTorch's fused float32 GELU and sigmoid give an element other bits in a vectorised loop's scalar tail; these
    # are spelled in ops that do not (tanh, exp, add, divide).
    op, reference = ACTIVATIONS[name]
    x = randn(3000, seed=12, dtype=dtype, scale=6)
    whole = op(x)
    for length in (1, 7, 37, 1000):
        pieces = torch.cat([op(x[i : i + length]) for i in range(0, x.numel(), length)])
        assert torch.equal(pieces, whole), f"{name} over pieces of {length} elements differs from over all"
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(whole.float(), reference(x.float()), atol=tolerance, rtol=tolerance)
