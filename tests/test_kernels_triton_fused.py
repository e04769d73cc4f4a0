"""Specification of the fused Triton kernels (residual add + RMSNorm, SiLU * up, q/k norm + RoPE + cache write):
each computes what its composed torch ops compute, to bf16 accuracy and with the same roundings, and gives a row
the same bits whatever the batch around it. Needs CUDA and Triton; skipped cleanly without them.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from pinned_backend.kernels.cpu_default import TorchKernels

DEVICE = "cuda"
FULL = 512
ROW_COUNTS = [1, 2, 3, 7, 64, 65, 200, 511]
WINDOW_STARTS = [1, 5, 77]
# Qwen3-1.7B: 16 query heads and 8 KV heads of 128.
HQ, HKV, D, PAGE = 16, 8, 128, 16
EPS = 1e-6

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def triton_ops() -> ModuleType:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import pinned_backend.kernels.triton as ops

    return ops


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.to(device=DEVICE, dtype=torch.bfloat16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def assert_mostly_bit_equal(out: torch.Tensor, composed: torch.Tensor, what: str) -> None:
    """The same roundings in the same order: only exp, sqrt and division may differ in their last fp32 bit."""
    agree = float((out == composed).float().mean())
    assert agree >= 0.99, f"{what}: only {agree:.2%} of elements match the composed ops bit for bit"


def assert_rows_invariant(run: Callable[[slice], tuple[torch.Tensor, ...]], what: str) -> None:
    """run(rows) computes a step made of those rows; each row's outputs must not change with the step."""
    full = run(slice(0, FULL))
    for m in ROW_COUNTS:
        for got, want in zip(run(slice(0, m)), full, strict=True):
            assert torch.equal(got, want[:m]), f"{what}: rows changed when T went from {FULL} to {m}"
    for start in WINDOW_STARTS:
        for got, want in zip(run(slice(start, start + FULL)), full, strict=True):
            assert torch.equal(got[: FULL - start], want[start:]), (
                f"{what}: a row's bits changed when its step started at row {start}"
            )


@gpu
@needs_cuda
@pytest.mark.parametrize("width", [2048, 128])
def test_add_rms_norm_is_an_add_then_rms_norm_and_is_invariant(triton_ops: ModuleType, width: int) -> None:
    x = randn(FULL + 100, width, seed=1, scale=3)
    delta = randn(FULL + 100, width, seed=2)
    weight = (torch.rand(width, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEVICE, torch.bfloat16)
    summed, normed = triton_ops.add_rms_norm(x[:FULL], delta[:FULL], weight, EPS)

    assert torch.equal(summed, x[:FULL] + delta[:FULL]), "the residual sum must be torch's add, rounded once"
    assert torch.equal(normed, triton_ops.rms_norm(summed, weight, EPS)), (
        "add_rms_norm must reduce in rms_norm's tree: its normed rows differ from rms_norm of the sum"
    )
    s64 = summed.double()
    ref = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    assert rel_err(normed, ref) < 1e-2
    _, composed = TorchKernels().add_rms_norm(x[:FULL], delta[:FULL], weight, EPS)
    assert_mostly_bit_equal(normed, composed, "add_rms_norm")
    assert_rows_invariant(
        lambda rows: triton_ops.add_rms_norm(x[rows], delta[rows], weight, EPS), "add_rms_norm"
    )


@gpu
@needs_cuda
def test_add_rms_norm_of_gathered_rows_equals_those_rows_of_the_whole(triton_ops: ModuleType) -> None:
    # The model adds and normalises only the rows that need logits after its last layer.
    x, delta = randn(300, 2048, seed=4, scale=3), randn(300, 2048, seed=5)
    weight = randn(2048, seed=6).abs() + 0.5
    whole = triton_ops.add_rms_norm(x, delta, weight, EPS)
    rows = torch.tensor([299, 0, 17, 17], device=DEVICE)
    for got, want in zip(triton_ops.add_rms_norm(x[rows], delta[rows], weight, EPS), whole, strict=True):
        assert torch.equal(got, want[rows])


@gpu
@needs_cuda
@pytest.mark.parametrize("inner", [6144, 1000])
def test_silu_mul_matches_float64_and_the_composed_ops_and_is_invariant(
    triton_ops: ModuleType, inner: int
) -> None:
    gate_up = randn(FULL + 100, 2 * inner, seed=7, scale=4)
    out = triton_ops.silu_mul(gate_up[:FULL])
    assert out.shape == (FULL, inner) and out.dtype == torch.bfloat16
    gate, up = gate_up[:FULL].double().chunk(2, dim=-1)
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < 1e-2
    assert_mostly_bit_equal(out, TorchKernels().silu_mul(gate_up[:FULL]), "silu_mul")
    assert_rows_invariant(lambda rows: (triton_ops.silu_mul(gate_up[rows]),), "silu_mul")


def rope_tables(max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_positions, D/2] float32, as the model builds them."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    angles = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def qkv_reference(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 q, k (normalised, rotated) and v, each [T, H, D]."""
    x = qkv.double()
    t = x.shape[0]
    q, k, v = x.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.reshape(t, HQ, D), k.reshape(t, HKV, D), v.reshape(t, HKV, D)

    def norm(h: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return h
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()

    c, s = cos[positions].double()[:, None], sin[positions].double()[:, None]

    def rotate(h: torch.Tensor) -> torch.Tensor:
        h1, h2 = h[..., : D // 2], h[..., D // 2 :]
        return torch.cat([h1 * c - h2 * s, h2 * c + h1 * s], dim=-1)

    return rotate(norm(q, q_norm)), rotate(norm(k, k_norm)), v


class PoisonedCache:
    """A fresh paged cache full of NaN, so that a slot written by mistake, or one not written, shows."""

    def __init__(self, num_blocks: int) -> None:
        self.k = torch.full((num_blocks, PAGE, HKV, D), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        self.v = torch.full_like(self.k, float("nan"))

    def written(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at `slots`, [T, Hkv, D], after checking that exactly those slots were written."""
        for name, cache in (("k", self.k), ("v", self.v)):
            rows = cache.view(-1, HKV, D)
            named = torch.zeros(rows.shape[0], dtype=torch.bool, device=DEVICE)
            named[slots] = True
            assert not rows[named].isnan().any(), f"a named slot of the {name} cache was not (wholly) written"
            assert rows[~named].isnan().all(), f"the {name} cache was written outside the named slots"
        return self.k.view(-1, HKV, D)[slots], self.v.view(-1, HKV, D)[slots]


@gpu
@needs_cuda
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
def test_qkv_rope_cache_matches_float64_writes_only_its_slots_and_is_invariant(
    triton_ops: ModuleType, qk_norm: bool
) -> None:
    n_rows, max_positions, num_blocks = FULL + 100, 4096, 48
    generator = torch.Generator().manual_seed(8)
    qkv = randn(n_rows, (HQ + 2 * HKV) * D, seed=9, scale=2)
    q_norm = randn(D, seed=10).abs() + 0.5 if qk_norm else None
    k_norm = randn(D, seed=11).abs() + 0.5 if qk_norm else None
    cos, sin = rope_tables(max_positions)
    positions = torch.randint(0, max_positions, (n_rows,), generator=generator).to(DEVICE)
    slots = torch.randperm(num_blocks * PAGE, generator=generator)[:n_rows].to(DEVICE)

    def run(rows: slice) -> tuple[torch.Tensor, ...]:
        cache = PoisonedCache(num_blocks)
        q = triton_ops.qkv_rope_cache(
            qkv[rows], q_norm, k_norm, EPS, cos, sin, positions[rows], slots[rows], cache.k, cache.v
        )
        return (q, *cache.written(slots[rows]))

    q, k, v = run(slice(0, FULL))
    assert q.shape == (FULL, HQ, D) and q.dtype == torch.bfloat16
    q_ref, k_ref, v_ref = qkv_reference(qkv[:FULL], q_norm, k_norm, cos, sin, positions[:FULL])
    assert rel_err(q, q_ref) < 1e-2 and rel_err(k, k_ref) < 1e-2
    assert torch.equal(v.double(), v_ref), "values must reach the cache unchanged"

    composed = PoisonedCache(num_blocks)
    q_composed = TorchKernels().qkv_rope_cache(
        qkv[:FULL], q_norm, k_norm, EPS, cos, sin, positions[:FULL], slots[:FULL], composed.k, composed.v
    )
    k_composed, _ = composed.written(slots[:FULL])
    assert_mostly_bit_equal(q, q_composed, "qkv_rope_cache q")
    assert_mostly_bit_equal(k, k_composed, "qkv_rope_cache k")
    assert_rows_invariant(run, "qkv_rope_cache")


@gpu
@needs_cuda
def test_fused_ops_replay_in_a_cuda_graph_with_new_inputs(triton_ops: ModuleType) -> None:
    # Decode steps are captured once and replayed: a launcher that read a tensor on the host would fail to
    # capture, or replay the first step's values.
    x, delta, weight = randn(4, 2048, seed=12), randn(4, 2048, seed=13), randn(2048, seed=14).abs() + 0.5
    gate_up = randn(4, 2 * 6144, seed=15)
    qkv = randn(4, (HQ + 2 * HKV) * D, seed=16)
    norm = randn(D, seed=17).abs() + 0.5
    cos, sin = rope_tables(64)
    positions = torch.tensor([0, 5, 63, 9], device=DEVICE)
    slots = torch.tensor([3, 40, 17, 0], device=DEVICE)
    cache = PoisonedCache(4)

    def step() -> tuple[torch.Tensor, ...]:
        summed, normed = triton_ops.add_rms_norm(x, delta, weight, EPS)
        act = triton_ops.silu_mul(gate_up)
        q = triton_ops.qkv_rope_cache(qkv, norm, norm, EPS, cos, sin, positions, slots, cache.k, cache.v)
        return summed, normed, act, q

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    for seed in (20, 30):
        x.copy_(randn(4, 2048, seed=seed))
        gate_up.copy_(randn(4, 2 * 6144, seed=seed + 1))
        qkv.copy_(randn(4, (HQ + 2 * HKV) * D, seed=seed + 2))
        positions.copy_(torch.tensor([seed, 1, 2, 3]))
        slots.copy_(torch.tensor([seed, 41, 18, 1]))
        graph.replay()
        replayed = [t.clone() for t in captured]
        replayed_cache = cache.k.clone()
        eager = step()
        for got, want in zip(replayed, eager, strict=True):
            assert torch.equal(got, want), "a replayed step differs from the same step run eagerly"
        assert torch.equal(replayed_cache.nan_to_num(), cache.k.nan_to_num())
