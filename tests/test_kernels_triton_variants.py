"""Specification of the GPU kernels the model families add: attention with a sliding window, soft-capped scores and
sinks, latent attention over a compressed cache, GeGLU, the per-head matmul and biased experts. Each is right to bf16
accuracy against a float64 reference and gives a row the same bits in a step of 1, 8, 32 or 128 rows, on either
attention path, prefilled or decoded. Needs CUDA and Triton; skipped cleanly without them (the same kernels' logic is
checked on the CPU under Triton's interpreter, tests/test_kernels_interpreted.py).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

from pinned_backend.kernels.unfused import clamped_swiglu, gelu_tanh
from tests.support import kernel_reference

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE, DTYPE, PAGE, SPLIT = "cuda", torch.bfloat16, 16, 128
BATCHES = (1, 8, 32, 128)
# (query heads, KV heads, head size): gpt-oss-20b's, Gemma 3 12B's, Qwen3-1.7B's.
HEADS = {"gpt-oss": (64, 8, 64), "gemma3": (16, 8, 256), "qwen3": (16, 8, 128)}


@pytest.fixture
def kernels() -> Any:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pinned_backend.kernels.triton import TritonKernels

    return TritonKernels(kv_split_size=SPLIT)


def paged(
    lengths: list[int], heads: int, dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random keys and values for sequences of `lengths` in shuffled pages; unowned slots hold NaN."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = [-(-n // PAGE) for n in lengths]
    total = sum(pages) + 2
    shape = (total, PAGE, heads, dim)
    k_cache = torch.randn(shape, device=DEVICE, generator=generator).to(DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, generator=generator).to(DTYPE)
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = torch.zeros((len(lengths), max(pages) + 1), dtype=torch.int32)
    owned = torch.zeros(total, dtype=torch.bool)
    for s, n in enumerate(pages):
        for i in range(n):
            tables[s, i] = block = order.pop()
            owned[block] = True
    k_cache[~owned.to(DEVICE)] = float("nan")
    v_cache[~owned.to(DEVICE)] = float("nan")
    return k_cache, v_cache, tables.to(DEVICE)


def variants(hq: int) -> dict[str, dict[str, Any]]:
    sinks = torch.linspace(-1.0, 2.0, hq, device=DEVICE)
    return {
        "a window": {"window": 128},
        "soft-capped": {"softcap": 2.0},
        "sinks": {"sinks": sinks},
        "all three": {"window": 300, "softcap": 2.0, "sinks": sinks},
    }


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


@gpu
@needs_cuda
@pytest.mark.parametrize("model", list(HEADS))
def test_attention_variants_are_right_and_bit_identical_across_batch_sizes_and_paths(
    kernels: Any, model: str
) -> None:
    from pinned_backend.kernels.triton.attention import Variant, paged_attention

    hq, hkv, d = HEADS[model]
    lengths = [
        700,
        *torch.randint(1, 900, (max(BATCHES) - 1,), generator=torch.Generator().manual_seed(1)).tolist(),
    ]
    k_cache, v_cache, tables = paged(lengths, hkv, d, seed=2)
    generator = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(len(lengths), hq, d, device=DEVICE, generator=generator).to(DTYPE) * 2
    last = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) - 1
    seqs = torch.arange(len(lengths), dtype=torch.int32, device=DEVICE)
    for name, keys in variants(hq).items():
        attend = partial(
            kernels.attention, k_cache=k_cache, v_cache=v_cache, block_tables=tables, scale=d**-0.5
        )
        decoded = {b: attend(q[:b], query_seq=seqs[:b], query_pos=last[:b], **keys) for b in BATCHES}
        for b in BATCHES:
            assert torch.equal(decoded[b][0], decoded[1][0]), (
                f"{model}, {name}: decode at batch {b} changed bits"
            )
        variant = Variant(keys.get("window"), keys.get("softcap"), keys.get("sinks"))
        for path in ("serial", "chunks"):
            forced = paged_attention(
                q[:8],
                k_cache,
                v_cache,
                tables,
                seqs[:8],
                last[:8],
                d**-0.5,
                SPLIT,
                path=path,
                variant=variant,
            )
            assert torch.equal(forced, decoded[8]), f"{model}, {name}: the {path} path changed bits"
        cpu = [
            t.cpu() for t in (q[:4], k_cache.nan_to_num(), v_cache.nan_to_num(), tables, seqs[:4], last[:4])
        ]
        keys_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in keys.items()}
        reference = kernel_reference.attention(*cpu, d**-0.5, **keys_cpu)
        assert _rel_err(decoded[8][:4], reference) < 1e-2, f"{model}, {name}: not the reference's function"
        # A prefill of the first sequence, every position at once: a position's row is its decode step's.
        positions = torch.arange(700, dtype=torch.int32, device=DEVICE)
        prefill = attend(q[:1].repeat(700, 1, 1), query_seq=seqs[:1].repeat(700), query_pos=positions, **keys)
        assert torch.equal(prefill[699], decoded[1][0]), f"{model}, {name}: prefill and decode differ"


@gpu
@needs_cuda
def test_latent_attention_at_deepseek_v3s_shapes_is_right_and_bit_identical_across_batch_sizes(
    kernels: Any,
) -> None:
    heads, latent, rope = 128, 512, 64
    lengths = torch.randint(1, 600, (max(BATCHES),), generator=torch.Generator().manual_seed(4)).tolist()
    cache, _, tables = paged(lengths, 1, latent + rope, seed=5)
    generator = torch.Generator(device=DEVICE).manual_seed(6)
    q = torch.randn(len(lengths), heads, latent + rope, device=DEVICE, generator=generator).to(DTYPE) / 4
    last = torch.tensor(lengths, dtype=torch.int32, device=DEVICE) - 1
    seqs = torch.arange(len(lengths), dtype=torch.int32, device=DEVICE)
    attend = partial(kernels.latent_attention, cache=cache, block_tables=tables, scale=0.07, v_dim=latent)
    decoded = {b: attend(q[:b], query_seq=seqs[:b], query_pos=last[:b]) for b in BATCHES}
    for b in BATCHES:
        assert torch.equal(decoded[b][0], decoded[1][0]), f"latent attention at batch {b} changed bits"
    clean = cache.nan_to_num().cpu()
    cpu = (q[:3].cpu(), clean, clean, tables.cpu(), seqs[:3].cpu(), last[:3].cpu())
    reference = kernel_reference.attention(*cpu, 0.07)[..., :latent]
    assert _rel_err(decoded[8][:3], reference) < 1e-2


@gpu
@needs_cuda
def test_gelu_mul_head_matmul_and_biased_experts_give_a_row_the_same_bits_in_any_step(kernels: Any) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(7)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, device=DEVICE, generator=generator) * scale).to(DTYPE)

    gate_up = rand(128, 2 * 3840, scale=3)  # Gemma 3 12B's MLP width
    gated = kernels.gelu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _rel_err(gated, (gelu_tanh(gate.float()) * up.float()).double().cpu()) < 1e-2
    x, w = rand(128, 128, 128), rand(128, 512, 128, scale=0.1)  # DeepSeek-V3's q_nope into the latent
    heads = kernels.head_matmul(x, w)
    assert _rel_err(heads, torch.einsum("thk,hnk->thn", x.double(), w.double()).cpu()) < 1e-2
    h, gate_up_w, down = rand(128, 2880, scale=0.5), rand(32, 2 * 256, 2880, scale=0.02), rand(32, 2880, 256)
    biases = {"gate_up_bias": rand(32, 2 * 256), "down_bias": rand(32, 2880)}
    experts = torch.stack([torch.randperm(32, device=DEVICE)[:4] for _ in range(128)])
    weights = torch.rand(128, 4, device=DEVICE).softmax(-1)
    act = partial(clamped_swiglu, alpha=1.702, limit=7.0)
    mlp = partial(kernels.expert_mlp, gate_up=gate_up_w, down=down, activation=act, **biases)
    whole = mlp(h, experts=experts, weights=weights)
    for b in BATCHES:
        assert torch.equal(kernels.gelu_mul(gate_up[:b]), gated[:b]), f"gelu_mul at {b} rows"
        assert torch.equal(kernels.head_matmul(x[:b], w), heads[:b]), f"head_matmul at {b} rows"
        assert torch.equal(mlp(h[:b], experts=experts[:b], weights=weights[:b]), whole[:b]), (
            f"experts at {b} rows"
        )
