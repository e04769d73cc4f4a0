"""Specification of the two paths of the Triton paged attention: a decode query served by one program per KV chunk
gives the bits that one program walking all chunks gives, is right to bf16 accuracy, and does not depend on the
other sequences in its step. Needs CUDA and Triton; skipped cleanly without them. The choice of path is plain
Python and is checked everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from pinned_backend.kernels.triton.attention import choose_path
from tests.test_kernels_triton import attention_reference

DEVICE = "cuda"
DTYPE = torch.bfloat16
HQ, HKV, D, PAGE, SCALE = 16, 8, 128, 16, 128**-0.5  # Qwen3-1.7B's heads
POSITIONS = [1, 63, 64, 255, 256, 257, 700, 2000]

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

Attention = Callable[..., torch.Tensor]


@pytest.fixture
def attention() -> Attention:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from pinned_backend.kernels.triton.attention import paged_attention

    return paged_attention


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


class _Sequences:
    """Random queries, keys and values for sequences of the given lengths, in a paged cache of shuffled pages.

    Slots no sequence owns hold NaN, so a kernel that reads one shows it.
    """

    def __init__(self, lengths: Sequence[int], seed: int, heads: tuple[int, int, int] = (HQ, HKV, D)) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        hq, hkv, d = heads
        self.scale = d**-0.5

        def rand(n: int, heads: int) -> torch.Tensor:
            return torch.randn(n, heads, d, device=DEVICE, generator=gen).to(DTYPE)

        self.q = [rand(n, hq) for n in lengths]
        self.k = [rand(n, hkv) for n in lengths]
        self.v = [rand(n, hkv) for n in lengths]
        n_pages = [-(-n // PAGE) for n in lengths]
        total = sum(n_pages) + 3
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).tolist()
        self.k_cache = torch.full((total, PAGE, hkv, d), float("nan"), device=DEVICE, dtype=DTYPE)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        tables = torch.full((len(lengths), max(n_pages) + 2), -1, dtype=torch.int32)
        for s, n in enumerate(lengths):
            for i in range(n_pages[s]):
                blk = order.pop()
                tables[s, i] = blk
                lo, hi = i * PAGE, min((i + 1) * PAGE, n)
                self.k_cache[blk, : hi - lo] = self.k[s][lo:hi]
                self.v_cache[blk, : hi - lo] = self.v[s][lo:hi]
        self.tables = tables.to(DEVICE)

    def step(
        self, attention: Attention, queries: Sequence[tuple[int, int]], split: int, path: str = "auto"
    ) -> torch.Tensor:
        """One step of (sequence, position) queries, in that order."""
        q = torch.stack([self.q[s][p] for s, p in queries])
        seq = torch.tensor([s for s, _ in queries], dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([p for _, p in queries], dtype=torch.int32, device=DEVICE)
        return attention(q, self.k_cache, self.v_cache, self.tables, seq, pos, self.scale, split, path=path)

    def alone(self, attention: Attention, s: int, p: int, split: int) -> torch.Tensor:
        """Sequence s's query at p decoded by itself, with a block table of just that sequence's pages."""
        table = self.tables[s : s + 1, : -(-(p + 1) // PAGE)]
        seq = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        pos = torch.full((1,), p, dtype=torch.int32, device=DEVICE)
        return attention(self.q[s][p][None], self.k_cache, self.v_cache, table, seq, pos, self.scale, split)


def test_decode_and_verify_steps_take_the_chunks_path_while_the_workspace_fits() -> None:
    assert choose_path(1, 1, HQ, D, 2, "auto") == "chunks", "a lone decode query must spread over its chunks"
    assert choose_path(32, 32, HQ, D, 160, "auto") == "chunks"
    assert choose_path(40, 8, HQ, D, 2, "auto") == "chunks", "a verify pass of 5 tokens a sequence"
    assert choose_path(257, 32, HQ, D, 2, "auto") == "serial", (
        "a step with a prefill walks chunks in one program"
    )
    assert choose_path(256, 256, HQ, D, 160, "auto") == "serial", "a 335 MB workspace is past the limit"
    assert choose_path(1, 1, HQ, D, 2, "serial") == "serial"
    assert choose_path(300, 1, HQ, D, 2, "chunks") == "chunks"
    with pytest.raises(ValueError, match="unknown path"):
        choose_path(1, 1, HQ, D, 2, "fastest")  # type: ignore[arg-type]


@gpu
@needs_cuda
@pytest.mark.parametrize("split", [64, 128, 256])
def test_chunks_path_gives_the_serial_paths_bits(attention: Attention, split: int) -> None:
    data = _Sequences([2001, 37], seed=split)
    # A prefill step: more tokens than sequences, so one program serves several tokens and walks their chunks.
    prefill = data.step(attention, [(0, p) for p in range(2001)], split, path="serial")
    for p in POSITIONS:
        chunks = data.step(attention, [(0, p)], split, path="chunks")
        serial = data.step(attention, [(0, p)], split, path="serial")
        assert torch.equal(chunks, serial), f"split {split}, position {p}: the chunks path changed the bits"
        assert torch.equal(chunks[0], prefill[p]), f"split {split}, position {p}: decode differs from prefill"
        assert torch.equal(data.step(attention, [(0, p)], split), chunks), "the default path changed the bits"
    many = data.step(attention, [(0, p) for p in POSITIONS] + [(1, 36)], split, path="chunks")
    assert torch.equal(many[:-1], prefill[POSITIONS]), "tokens sharing a chunks-path step changed their bits"


@gpu
@needs_cuda
def test_a_head_group_that_does_not_divide_the_tile_keeps_the_bits_and_the_accuracy(
    attention: Attention,
) -> None:
    # SmolLM2-135M's heads: groups of 3 query heads, so a 16-row tile holds 5 tokens' rows and one spare row.
    data = _Sequences([701, 37], seed=40, heads=(9, 3, 64))
    prefill = data.step(attention, [(0, p) for p in range(701)], 128, path="serial")
    for p in (1, 63, 64, 255, 700):
        chunks = data.step(attention, [(0, p)], 128, path="chunks")
        assert torch.equal(chunks, data.step(attention, [(0, p)], 128, path="serial")), p
        assert torch.equal(chunks[0], prefill[p]), f"position {p}: decode differs from prefill"
        ref = attention_reference(data.q[0][p], data.k[0], data.v[0], p, data.scale)
        assert _rel_err(chunks[0], ref) < 1e-2, f"position {p} is wrong"


@gpu
@needs_cuda
@pytest.mark.parametrize("split", [64, 128, 256])
def test_chunks_path_matches_float64(attention: Attention, split: int) -> None:
    data = _Sequences([2001], seed=10 + split)
    for p in POSITIONS:
        out = data.step(attention, [(0, p)], split, path="chunks")[0]
        ref = attention_reference(data.q[0][p], data.k[0], data.v[0], p, SCALE)
        assert _rel_err(out, ref) < 1e-2, f"split {split}, position {p} is wrong"


@gpu
@needs_cuda
@pytest.mark.parametrize("split", [64, 128, 256])
def test_a_decoded_query_does_not_depend_on_the_other_sequences_in_the_step(
    attention: Attention, split: int
) -> None:
    lengths = [2001, *torch.randint(1, 2100, (31,), generator=torch.Generator().manual_seed(split)).tolist()]
    data = _Sequences(lengths, seed=20 + split)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(split)).tolist()
    together = data.step(attention, [(s, lengths[s] - 1) for s in order], split)
    for row, s in enumerate(order):
        # Alone, the step has another grid and another workspace; the bits must stay.
        alone = data.alone(attention, s, lengths[s] - 1, split)
        assert torch.equal(alone[0], together[row]), f"sequence {s} changed with the other 31 in its step"


@gpu
@needs_cuda
def test_a_decode_step_replays_in_a_cuda_graph(attention: Attention) -> None:
    lengths = [2001, 700, 256, 1]
    data = _Sequences(lengths, seed=30)
    seq = torch.arange(4, dtype=torch.int32, device=DEVICE)
    pos = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    q = torch.empty(4, HQ, D, device=DEVICE, dtype=DTYPE)

    def decode() -> torch.Tensor:
        return attention(q, data.k_cache, data.v_cache, data.tables, seq, pos, SCALE, 256)

    decode()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode()
    for step in [(2000, 699, 255, 0), (300, 256, 5, 0), (1, 0, 64, 0)]:
        pos.copy_(torch.tensor(step, dtype=torch.int32))
        q.copy_(torch.stack([data.q[s][p] for s, p in enumerate(step)]))
        graph.replay()
        assert torch.equal(out, decode()), f"positions {step}: the replayed step differs from an eager one"
