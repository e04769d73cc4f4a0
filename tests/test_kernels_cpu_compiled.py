"""Specification of the compiled CPU attention (kernels.cpu_paged_attention) and of how its library is built
(kernels.native): right against the float64 reference in every cache dtype and variant, each query's bits its own
whatever the step, the thread count or how its cache was filled, and a clear fallback where nothing compiles."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from pinned_backend.kernels import native
from pinned_backend.kernels.cpu_invariant import CpuInvariantKernels
from pinned_backend.kernels.cpu_layer_ops import CompiledLayerOps
from pinned_backend.kernels.cpu_paged_attention import CompiledAttention
from pinned_backend.runtime import BackendSettings, load_runtime
from tests.support import kernel_reference as reference
from tests.support.backend_checkpoint import write_random_checkpoint
from tests.test_kernels_cpu import VARIANTS, make_paged, randn


@pytest.fixture(scope="module")
def compiled() -> CompiledAttention:
    return CompiledAttention.load(32)


def steps(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position of every sequence, as one big prefill."""
    seq = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, dtype=torch.int32) for n in lengths])
    return seq, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["plain", *VARIANTS])
def test_compiled_attention_matches_the_float64_reference_in_every_cache_dtype(
    compiled: CompiledAttention, dtype: torch.dtype, variant: str
) -> None:
    options = VARIANTS.get(variant, {})
    k_cache, v_cache, tables = make_paged([1, 17, 70, 33], 16, (8, 2), 32, seed=6, dtype=dtype)
    seq = torch.tensor([0, 1, 2, 2, 2, 2, 3, 1], dtype=torch.int32)
    pos = torch.tensor([0, 16, 66, 67, 68, 69, 32, 3], dtype=torch.int32)
    q = randn(8, 8, 32, seed=7) * 3
    out = compiled(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, **options)
    expected = reference.attention(q, k_cache, v_cache, tables, seq, pos, 32**-0.5, **options)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize(
    ("heads", "dim", "block"),
    [((9, 3), 64, 16), ((16, 1), 40, 8), ((64, 1), 24, 16), ((6, 6), 100, 4)],
    ids=["smollm2-groups", "a-head-width-off-the-lanes", "more-heads-than-a-tile", "no-grouping"],
)
def test_compiled_attention_serves_any_grouping_and_head_width(
    heads: tuple[int, int], dim: int, block: int
) -> None:
    attend = CompiledAttention.load(block * 2)
    lengths = [45, 3, 29]
    k_cache, v_cache, tables = make_paged(lengths, block, heads, dim, seed=31, dtype=torch.bfloat16)
    seq, pos = steps(lengths)
    q = randn(seq.numel(), heads[0], dim, seed=32, dtype=torch.bfloat16)
    out = attend(q, k_cache, v_cache, tables, seq, pos, dim**-0.5)
    assert out.dtype == torch.bfloat16
    expected = reference.attention(q, k_cache, v_cache, tables, seq, pos, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)  # bf16's output rounding
    wide = attend(q.float(), k_cache, v_cache, tables, seq, pos, dim**-0.5)
    torch.testing.assert_close(wide.double(), expected, atol=2e-6, rtol=2e-6)


def test_latent_attention_computes_only_the_values_first_elements_with_their_bits(
    compiled: CompiledAttention,
) -> None:
    cache, _, tables = make_paged([40, 7], 16, (1, 1), 48, seed=33, dtype=torch.bfloat16)
    seq, pos = steps([40, 7])
    q = randn(seq.numel(), 16, 48, seed=34)
    whole = compiled(q, cache, cache, tables, seq, pos, 0.2)
    first = compiled(q, cache, cache, tables, seq, pos, 0.2, value_dim=32)
    assert first.shape == (seq.numel(), 16, 32)
    assert torch.equal(first, whole[..., :32])
    kernels = CpuInvariantKernels(kv_split_size=32)
    assert torch.equal(kernels.latent_attention(q, cache, tables, seq, pos, 0.2, 32), first)


def test_a_querys_bits_are_its_own_at_any_thread_count(compiled: CompiledAttention) -> None:
    lengths = [130, 64, 9]
    k_cache, v_cache, tables = make_paged(lengths, 16, (8, 2), 32, seed=35, dtype=torch.bfloat16)
    seq, pos = steps(lengths)
    q = randn(seq.numel(), 8, 32, seed=36)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(compiled(q, k_cache, v_cache, tables, seq, pos, 0.17, window=50, softcap=2.0))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_a_querys_bits_do_not_depend_on_how_its_cache_was_filled(compiled: CompiledAttention) -> None:
    # A sequence's last query after a whole prefill, after chunks, or decoded alone: the cache holds the same keys
    # and values in other blocks, and the query meets other neighbours in its step, yet its bits are one.
    length = 100
    k_cache, v_cache, tables = make_paged([length, length], 16, (8, 2), 32, seed=37, dtype=torch.bfloat16)
    k_cache[tables[1, :7].long()] = k_cache[tables[0, :7].long()]
    v_cache[tables[1, :7].long()] = v_cache[tables[0, :7].long()]
    q = randn(length, 8, 32, seed=38)
    whole = compiled(q, k_cache, v_cache, tables, *steps([length]), 0.17)
    chunked = torch.cat(
        [
            compiled(
                q[start : start + 30], k_cache, v_cache, tables[1:], *_positions(start, 30, length), 0.17
            )
            for start in range(0, length, 30)
        ]
    )
    assert torch.equal(whole, chunked)


def _positions(start: int, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, min(start + count, length), dtype=torch.int32)
    return torch.zeros_like(pos), pos


def test_caches_it_cannot_read_are_refused(compiled: CompiledAttention) -> None:
    k_cache, v_cache, tables = make_paged([5], 16, (2, 2), 8, seed=39, dtype=torch.float32)
    seq, pos = torch.tensor([0], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"float16 queries and caches, not torch\.float32 queries over a torch\.float64"
    ):
        compiled(torch.zeros(1, 2, 8), k_cache.double(), v_cache.double(), tables, seq, pos, 1.0)
    with pytest.raises(ValueError, match=r"not torch\.float64 queries"):
        compiled(torch.zeros(1, 2, 8, dtype=torch.float64), k_cache, v_cache, tables, seq, pos, 1.0)
    with pytest.raises(ValueError, match="do not fit a cache of 2 KV heads"):
        compiled(torch.zeros(1, 3, 8), k_cache, v_cache, tables, seq, pos, 1.0)


def test_the_library_is_built_once_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPIN_KERNEL_CACHE", str(tmp_path))
    source = tmp_path / "answer.c"
    source.write_text("int answer(void) { return 42; }\n")
    first = native.build(source)
    assert first.library.answer() == 42 and first.path.parent == tmp_path
    built_at = first.path.stat().st_mtime_ns
    assert native.build(source).path == first.path and first.path.stat().st_mtime_ns == built_at
    source.write_text("int answer(void) { return 43; }\n")
    changed = native.build(source)
    assert changed.path != first.path and changed.library.answer() == 43


def test_without_a_compiler_the_torch_ops_serve_and_the_stack_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STACKPIN_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.BuildError, match=r"no C compiler: .*install gcc"):
        CompiledAttention.load(32)
    kernels = CpuInvariantKernels(kv_split_size=32)
    assert kernels.cpu_kernels == "torch" and "no C compiler" in kernels.kernels_unbuilt
    checkpoint = write_random_checkpoint(tmp_path / "random-qwen3", with_tokenizer=True)
    said: list[str] = []
    settings = BackendSettings(model=checkpoint, block_size=4, kv_split_size=8)
    runtime = load_runtime(settings, report=said.append)
    assert runtime.stack["hardware_detail"]["kernels"] == "torch"
    assert any("torch ops serve instead" in line for line in said)
    monkeypatch.delenv("CC")
    assert load_runtime(settings).stack["hardware_detail"]["kernels"] == "compiled"


def test_a_compiler_that_fails_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: out of licences' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("STACKPIN_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(native.BuildError, match=r"failed:\n.*out of licences"):
        CompiledAttention.load(32)
    assert not any(os.scandir(tmp_path / "cache")), "a failed build leaves nothing to load"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_norms_give_a_row_its_bits_alone_and_at_any_thread_count(dtype: torch.dtype) -> None:
    ops = CompiledLayerOps.load()
    x, delta = randn(100, 576, seed=40, dtype=dtype) * 3, randn(100, 576, seed=41, dtype=dtype)
    weight = randn(576, seed=42, dtype=dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append((ops.rms_norm(x, weight, 1e-5), *ops.add_rms_norm(x, delta, weight, 1e-5)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    normed, summed, after_add = results[0]
    for row in (0, 63, 99):
        assert torch.equal(ops.rms_norm(x[row : row + 1], weight, 1e-5), normed[row : row + 1])
        assert torch.equal(
            ops.add_rms_norm(x[row : row + 1], delta[row : row + 1], weight, 1e-5)[1],
            after_add[row : row + 1],
        )
    x64 = x.double()
    expected = weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(normed.double(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(summed, x + delta)


def test_indices_outside_the_tables_or_the_cache_are_refused_before_anything_is_read_or_written(
    compiled: CompiledAttention,
) -> None:
    k_cache, v_cache, tables = make_paged([20, 5], 16, (2, 2), 8, seed=43, dtype=torch.float32)
    q = torch.zeros(1, 2, 8)

    def at(seq: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([seq], dtype=torch.int32), torch.tensor([pos], dtype=torch.int32)

    # no such sequence; past the table's blocks; a negative position
    for seq, pos in ((5, 3), (0, 16 * tables.shape[1]), (0, -1)):
        with pytest.raises(ValueError, match="falls outside the block tables"):
            compiled(q, k_cache, v_cache, tables, *at(seq, pos), 1.0)
    broken = tables.clone()
    broken[0, 1] = k_cache.shape[0]  # a block past the cache
    with pytest.raises(ValueError, match="falls outside the block tables"):
        compiled(q, k_cache, v_cache, broken, *at(0, 19), 1.0)
    with pytest.raises(ValueError, match="3 attention sinks for 2 query heads"):
        compiled(q, k_cache, v_cache, tables, *at(0, 4), 1.0, sinks=torch.zeros(3))
    ops = CompiledLayerOps.load()
    qkv = torch.zeros(1, 6 * 8)
    cos, sin = torch.ones(10, 4), torch.zeros(10, 4)
    before = k_cache.clone()
    for pos, slot in ((10, 0), (0, k_cache.shape[0] * 16), (0, -1)):
        with pytest.raises(ValueError, match="falls outside the rotary tables"):
            ops.rope_cache(qkv, cos, sin, torch.tensor([pos]), torch.tensor([slot]), k_cache, v_cache)
    assert torch.equal(k_cache, before), "a refused write writes nothing"
    with pytest.raises(ValueError, match="takes a weight of that many"):
        ops.rms_norm(torch.zeros(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="cannot take a delta"):
        ops.add_rms_norm(torch.zeros(2, 8), torch.zeros(1, 8), torch.ones(8), 1e-5)


def test_an_unwritable_kernel_cache_is_a_clear_build_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("STACKPIN_KERNEL_CACHE", str(blocked / "kernels"))
    with pytest.raises(native.BuildError, match="set STACKPIN_KERNEL_CACHE to a writable folder"):
        CompiledAttention.load(32)
    assert CpuInvariantKernels(kv_split_size=32).cpu_kernels == "torch"
