"""Specification of the CPU kernels: each op agrees with the float64 reference, and the batch_invariant ones give
a row the same bits whatever the batch around it (its size, the row's position, the other rows' contents)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pinned_backend.kernels import select_kernels
from pinned_backend.kernels.cpu_default import TorchKernels
from pinned_backend.kernels.cpu_invariant import CpuInvariantKernels
from tests.support import kernel_reference as reference

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
ROW_COUNTS = (1, 2, 5, 16, 17, 40)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_rows_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """Row i of op(x[:m]) must equal op of that row alone, and op of that row amid other rows, bit for bit."""
    alone = [op(x[i : i + 1]) for i in range(x.shape[0])]
    for m in ROW_COUNTS:
        batched = op(x[:m])
        for i in range(m):
            assert torch.equal(batched[i : i + 1], alone[i]), f"row {i} of {m} differs from the row alone"
    noise = randn(7, *x.shape[1:], seed=99, dtype=x.dtype)
    mixed = op(torch.cat([noise[:3], x[5:6], noise[3:]]))
    assert torch.equal(mixed[3:4], alone[5]), "a row's result changed with its neighbours' contents"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(256, 768), (1024, 300)])
def test_invariant_matmul_matches_reference_and_is_batch_invariant(
    dtype: torch.dtype, k: int, n: int
) -> None:
    kernels = CpuInvariantKernels()
    x, w = randn(40, k, seed=1, dtype=dtype), randn(n, k, seed=2, dtype=dtype) / k**0.5
    expected = reference.matmul(x, w)
    torch.testing.assert_close(
        kernels.matmul(x, w).double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )
    assert_rows_invariant(lambda rows: kernels.matmul(rows, w), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (576, 3072)])
def test_invariant_matmul_through_a_prepared_weight_gives_a_short_block_the_bits_of_a_full_one(
    dtype: torch.dtype, k: int, n: int
) -> None:
    # SmolLM2's qkv, down and gate_up shapes; a short last block is padded only as far as `prepare` proved is
    # needed for this shape, which must leave every row the bits of a block of gemm_rows rows.
    kernels = CpuInvariantKernels()
    x, w = randn(40, k, seed=1, dtype=dtype), randn(n, k, seed=2, dtype=dtype) / k**0.5
    prepared = kernels.prepare(w)
    torch.testing.assert_close(
        kernels.matmul(x, prepared).double(),
        reference.matmul(x, w),
        atol=TOLERANCE[dtype],
        rtol=TOLERANCE[dtype],
    )
    assert_rows_invariant(lambda rows: kernels.matmul(rows, prepared), x)
    full_block = kernels.matmul(x[:16], prepared)
    for m in range(1, 16):
        assert torch.equal(kernels.matmul(x[:m], prepared), full_block[:m]), f"{m} rows differ from 16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (1536, 576), (576, 49152)])
def test_invariant_matmul_gives_every_row_of_a_long_step_the_bits_of_a_block_of_16(
    dtype: torch.dtype, k: int, n: int
) -> None:
    # A step of many rows goes through the widest blocks `prepare` proved for the shape, then blocks of 16: whatever
    # the step's length, each row has the bits a block of 16 rows gives it.
    kernels = CpuInvariantKernels()
    x, w = randn(300, k, seed=3, dtype=dtype), randn(n, k, seed=4, dtype=dtype) / k**0.5
    prepared = kernels.prepare(w)
    by_sixteen = torch.cat([kernels.matmul(x[i : i + 16], prepared) for i in range(0, 300, 16)])
    for rows in (300, 256, 129, 47, 33):
        assert torch.equal(kernels.matmul(x[:rows], prepared), by_sixteen[:rows]), f"a step of {rows} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [128, 2048, 40000])
def test_invariant_rms_norm_matches_reference_and_is_batch_invariant(dtype: torch.dtype, width: int) -> None:
    # 40000 is wider than the size at which PyTorch splits a lone row's sum across threads.
    kernels = CpuInvariantKernels()
    x, weight = randn(40, width, seed=3, dtype=dtype), randn(width, seed=4, dtype=dtype)
    out = kernels.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    expected = reference.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype] * 4, rtol=TOLERANCE[dtype])
    assert_rows_invariant(lambda rows: kernels.rms_norm(rows, weight, 1e-6), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_log_softmax_matches_reference_and_is_batch_invariant(dtype: torch.dtype) -> None:
    kernels = CpuInvariantKernels()
    x = randn(40, 151936, seed=5, dtype=dtype) * 4  # Qwen3's vocabulary width
    out = kernels.log_softmax(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference.log_softmax(x.float()), atol=1e-4, rtol=1e-5)
    assert_rows_invariant(kernels.log_softmax, x)


def cpu_kernels(mode: str, compiled: bool, kv_split_size: int = 128) -> CpuInvariantKernels | TorchKernels:
    """A CPU kernel set with its compiled attention, or with the torch-op attention that serves where none builds."""
    if mode == "batch_invariant":
        return CpuInvariantKernels(kv_split_size=kv_split_size, compiled=compiled)
    return TorchKernels(compiled=compiled)


ATTENTIONS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-ops"])


def make_paged(
    lengths: list[int], block_size: int, heads: tuple[int, int], dim: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of random keys and values, each sequence's blocks scattered at random; and its block tables."""
    generator = torch.Generator().manual_seed(seed)
    blocks_each = [-(-n // block_size) for n in lengths]
    total = sum(blocks_each) + 3
    k_cache = torch.randn(total, block_size, heads[1], dim, generator=generator).to(dtype)
    v_cache = torch.randn(total, block_size, heads[1], dim, generator=generator).to(dtype)
    order = torch.randperm(total, generator=generator)
    tables = torch.zeros(len(lengths), max(blocks_each) + 2, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_each):
        tables[s, :n] = order[used : used + n].to(torch.int32)
        used += n
    return k_cache, v_cache, tables


@ATTENTIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_attention_matches_the_float64_reference(dtype: torch.dtype, mode: Any, compiled: bool) -> None:
    kernels = cpu_kernels(mode, compiled, kv_split_size=32)
    lengths = [1, 17, 70, 33]
    k_cache, v_cache, tables = make_paged(lengths, 16, (8, 2), 32, seed=6, dtype=dtype)
    # Some queries at the end of their sequence (decode), a run of them (prefill), one in the middle.
    seq = torch.tensor([0, 1, 2, 2, 2, 2, 3, 1], dtype=torch.int32)
    pos = torch.tensor([0, 16, 66, 67, 68, 69, 32, 3], dtype=torch.int32)
    q = randn(8, 8, 32, seed=7, dtype=dtype)
    out = kernels.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    expected = reference.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5)
    tolerance = TOLERANCE[dtype] * 10
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@ATTENTIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_gives_a_query_the_same_bits_whatever_else_is_in_the_step(
    dtype: torch.dtype,
    compiled: bool,
) -> None:
    kernels = CpuInvariantKernels(kv_split_size=32, compiled=compiled)
    generator = torch.Generator().manual_seed(8)
    lengths = torch.randint(1, 100, (6,), generator=generator).tolist()
    k_cache, v_cache, tables = make_paged(lengths, 16, (4, 2), 16, seed=9, dtype=dtype)
    # Every position of every sequence, as if the whole step were one big prefill.
    seq = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    q = randn(seq.numel(), 4, 16, seed=10, dtype=dtype)

    def attend(rows: torch.Tensor) -> torch.Tensor:
        return kernels.attention(q[rows], k_cache, v_cache, tables, seq[rows], pos[rows], 0.25)

    alone: dict[int, torch.Tensor] = {}
    everything = attend(torch.arange(seq.numel()))
    for size in (1, 2, 9, 33, seq.numel() // 2):
        rows = torch.randperm(seq.numel(), generator=generator)[:size]
        subset = attend(rows)
        for j, row in enumerate(rows.tolist()):
            if row not in alone:
                alone[row] = attend(torch.tensor([row]))[0]
            assert torch.equal(subset[j], alone[row]), (
                f"query {row} differs between a step of {size} and alone"
            )
            assert torch.equal(everything[row], alone[row]), (
                f"query {row} differs between the full step and alone"
            )


@ATTENTIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("split", "block"), [(128, 16), (8, 4)])
def test_invariant_attention_gives_a_decoding_query_its_bits_alone_in_steps_of_any_size(
    dtype: torch.dtype, split: int, block: int, compiled: bool
) -> None:
    # Decode steps: one query a sequence, contexts over several splits, steps of every size, so that the batched
    # products hold from one piece to many.
    kernels = CpuInvariantKernels(kv_split_size=split, compiled=compiled)
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(split, 5 * split, (24,), generator=generator).tolist()
    k_cache, v_cache, tables = make_paged(lengths, block, (8, 2), 32, seed=12, dtype=dtype)
    seq = torch.arange(len(lengths), dtype=torch.int32)
    pos = torch.tensor(lengths, dtype=torch.int32) - 1
    q = randn(len(lengths), 8, 32, seed=13, dtype=dtype)

    def attend(rows: torch.Tensor) -> torch.Tensor:
        return kernels.attention(q[rows], k_cache, v_cache, tables, seq[rows], pos[rows], 32**-0.5)

    alone = [attend(torch.tensor([row]))[0] for row in range(len(lengths))]
    for size in (2, 5, 12, 24):
        rows = torch.randperm(len(lengths), generator=generator)[:size]
        together = attend(rows)
        for j, row in enumerate(rows.tolist()):
            assert torch.equal(together[j], alone[row]), f"sequence {row} differs in a step of {size}"


VARIANTS: dict[str, dict[str, Any]] = {
    "a sliding window": {"window": 20},
    "soft-capped scores": {"softcap": 1.5},
    "attention sinks": {"sinks": torch.linspace(-1.0, 3.0, 8)},
    "all three": {"window": 40, "softcap": 1.5, "sinks": torch.linspace(-1.0, 3.0, 8)},
}


@ATTENTIONS
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_attention_variants_match_the_float64_reference(variant: str, mode: Any, compiled: bool) -> None:
    kernels = cpu_kernels(mode, compiled, kv_split_size=32)
    k_cache, v_cache, tables = make_paged([1, 17, 70, 33], 16, (8, 2), 32, seed=6, dtype=torch.float32)
    seq = torch.tensor([0, 1, 2, 2, 2, 2, 3, 1], dtype=torch.int32)
    pos = torch.tensor([0, 16, 66, 67, 68, 69, 32, 3], dtype=torch.int32)
    q = randn(8, 8, 32, seed=7) * 3  # large enough scores that a cap bites
    out = kernels.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, **VARIANTS[variant])
    expected = reference.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, **VARIANTS[variant])
    plain = reference.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5)
    assert not torch.allclose(expected, plain, atol=1e-3), f"{variant} changes nothing here, so tests nothing"
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@ATTENTIONS
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(
    "positions",
    [[69], list(range(70)), list(range(40, 70)), [0], [1, 0], [0, 2, 2]],
    ids=["decode", "prompt", "chunk", "first-token", "out-of-order", "repeated"],
)
def test_default_attention_of_one_sequence_matches_the_float64_reference(
    positions: list[int], window: int | None, compiled: bool
) -> None:
    # Without the compiled attention a step of one sequence goes to scaled_dot_product_attention, with no mask where
    # the query sees every key and its own causal mask for a whole prompt in order: each must still be the
    # reference's attention, as the compiled one's is.
    kernels = cpu_kernels("default", compiled)
    k_cache, v_cache, tables = make_paged([70], 16, (8, 2), 32, seed=21, dtype=torch.float32)
    count = len(positions)
    seq = torch.zeros(count, dtype=torch.int32)
    pos = torch.tensor(positions, dtype=torch.int32)
    q = randn(count, 8, 32, seed=22) * 3
    out = kernels.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, window=window)
    expected = reference.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, window=window)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@ATTENTIONS
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_a_step_without_queries_attends_to_nothing(mode: Any, compiled: bool) -> None:
    kernels = cpu_kernels(mode, compiled)
    k_cache, v_cache, tables = make_paged([20], 16, (8, 2), 32, seed=23, dtype=torch.float32)
    empty = torch.zeros(0, dtype=torch.int32)
    out = kernels.attention(randn(0, 8, 32, seed=24), k_cache, v_cache, tables, empty, empty, 32**-0.5)
    assert out.shape == (0, 8, 32)


@ATTENTIONS
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_invariant_attention_variants_give_a_query_the_same_bits_whatever_else_is_in_the_step(
    variant: str,
    compiled: bool,
) -> None:
    kernels = CpuInvariantKernels(kv_split_size=16, compiled=compiled)
    lengths = [90, 3, 47, 64]
    k_cache, v_cache, tables = make_paged(lengths, 16, (8, 2), 16, seed=13, dtype=torch.float32)
    seq = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    # Every score below zero: a row whose running maximum left -inf before it saw a key would show it.
    k_cache = k_cache.abs()
    q = -(randn(seq.numel(), 8, 16, seed=14) * 3).abs()

    def attend(rows: torch.Tensor) -> torch.Tensor:
        return kernels.attention(
            q[rows], k_cache, v_cache, tables, seq[rows], pos[rows], 0.25, **VARIANTS[variant]
        )

    # A late query alone, and in one tile with an early one of its sequence: then its tile starts splits before the
    # first key it sees.
    assert torch.equal(attend(torch.tensor([89])), attend(torch.tensor([5, 89]))[1:]), (
        f"{variant}: a tile changed bits"
    )
    everything = attend(torch.arange(seq.numel()))
    generator = torch.Generator().manual_seed(15)
    for size in (1, 5, 40):
        rows = torch.randperm(seq.numel(), generator=generator)[:size]
        assert torch.equal(attend(rows), everything[rows]), (
            f"{variant}: a step of {size} queries changed bits"
        )


@ATTENTIONS
def test_kv_split_size_must_be_a_multiple_of_the_block_size(compiled: bool) -> None:
    k_cache, v_cache, tables = make_paged([5], 16, (2, 2), 8, seed=11, dtype=torch.float32)
    kernels = CpuInvariantKernels(kv_split_size=24, compiled=compiled)
    seq, pos = torch.tensor([0], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of the KV cache block size 16"):
        kernels.attention(torch.zeros(1, 2, 8), k_cache, v_cache, tables, seq, pos, 1.0)


def test_non_positive_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="kv_split_size must be a positive"):
        CpuInvariantKernels(kv_split_size=0)


def test_select_kernels_picks_the_implementation_for_mode_and_device() -> None:
    assert isinstance(select_kernels("default", CPU), TorchKernels)
    invariant = select_kernels("batch_invariant", CPU, kv_split_size=64)
    assert isinstance(invariant, CpuInvariantKernels) and invariant.kv_split_size == 64
    assert invariant.mode == "batch_invariant"
    with pytest.raises(ValueError, match="unknown kernel mode 'fast'"):
        select_kernels("fast", CPU)  # type: ignore[arg-type]
    for mode in ("default", "batch_invariant"):
        with pytest.raises(ValueError, match="no kernels for device type 'meta'"):
            select_kernels(mode, torch.device("meta"))  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
def test_either_mode_on_cuda_without_a_device_is_a_clear_error(mode: str) -> None:
    with pytest.raises(
        RuntimeError, match=f"{mode} mode on cuda: this torch build or machine has no CUDA device"
    ):
        select_kernels(mode, torch.device("cuda"))  # type: ignore[arg-type]


def test_a_thread_count_changed_after_start_is_refused() -> None:
    kernels = CpuInvariantKernels()
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        with pytest.raises(RuntimeError, match=f"thread count changed from {before} to {before + 1}"):
            kernels.matmul(torch.ones(2, 4), torch.ones(3, 4))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", ["exp", "rsqrt", "tanh"])
def test_the_elementwise_ops_the_invariant_kernels_use_are_element_invariant(name: str) -> None:
    # Softmax partials use float32 exp, RMSNorm float32 rsqrt, soft-caps and GELU float32 tanh: an element's
    # result must not depend on the length of the tensor it sits in (PyTorch's scalar loop tails could otherwise
    # round it differently).
    op = getattr(torch, name)
    x = randn(3000, seed=12) * 5
    x = x.abs() + 0.01 if name == "rsqrt" else x
    whole = op(x)
    for length in (1, 7, 37, 1000):
        pieces = torch.cat([op(x[i : i + length]) for i in range(0, x.numel(), length)])
        assert torch.equal(pieces, whole), (
            f"float32 {name} over pieces of {length} differs from {name} over all"
        )
