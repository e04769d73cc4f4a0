"""Specification of the grouped expert matmul (pinned_backend.kernels.triton.expert_matmul): its host side, how a step's
rows are cut into blocks, and what it refuses; on a GPU (marked `gpu`), a mixture-of-experts layer of Qwen3-30B-A3B's
expert shapes against float64, each token's bits whatever the step around it, a captured step replayed whatever the
tokens choose, and the one-launch routing against routing.py's. Its kernels are checked under Triton's interpreter by
tests/test_kernels_interpreted.py. Skipped where Triton is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from pinned_backend.kernels.triton.expert_matmul import BLOCK_M, expert_blocks, expert_matmul


def test_each_experts_run_is_cut_into_blocks_that_never_cross_into_the_next() -> None:
    experts, starts, ends = expert_blocks([0, BLOCK_M + 1, BLOCK_M + 1, BLOCK_M + 4])
    assert experts == [0, 0, 2]
    assert starts == [0, BLOCK_M, BLOCK_M + 1]
    assert ends == [BLOCK_M + 1, BLOCK_M + 1, BLOCK_M + 4]


def test_offsets_that_do_not_cover_the_rows_are_refused() -> None:
    x, w = torch.zeros(5, 8, dtype=torch.float16), torch.zeros(2, 4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="rise from 0 to the 5 rows"):
        expert_matmul(x, w, torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match=r"offsets must be \[experts \+ 1\]"):
        expert_matmul(x, w, torch.tensor([0, 5]))


# On a GPU: a mixture-of-experts layer of Qwen3-30B-A3B's expert shapes (128 experts, top 8, hidden 2048, expert
# intermediate 768), in bf16.
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768


def gpu_layer(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    def matrix(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device="cuda") / shape[-1] ** 0.5).to(torch.bfloat16)

    return matrix(EXPERTS, 2 * INTERMEDIATE, HIDDEN), matrix(EXPERTS, HIDDEN, INTERMEDIATE)


def step_routing(generator: torch.Generator, tokens: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's TOP_K distinct experts and their weights; `skew` crowds the first experts (runs of many
    blocks)."""
    scores = torch.rand(tokens, EXPERTS, generator=generator, device="cuda")
    if skew:
        scores[:, :4] += 1.0
    experts = torch.argsort(scores, dim=1, descending=True)[:, :TOP_K]
    weights = torch.rand(tokens, TOP_K, generator=generator, device="cuda")
    return experts, weights / weights.sum(1, keepdim=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_on_a_gpu_the_experts_compute_each_tokens_mlp(triton_ops: Any, mode: str) -> None:
    generator = torch.Generator(device="cuda").manual_seed(1)
    gate_up, down = gpu_layer(generator)
    kernels = triton_ops.TritonKernels() if mode == "batch_invariant" else triton_ops.CublasKernels()
    for tokens, skew in ((1, False), (37, True), (300, False)):
        h = torch.randn(tokens, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
        experts, weights = step_routing(generator, tokens, skew)
        out = kernels.expert_mlp(h, gate_up, down, experts, weights).double()
        reference = torch.zeros_like(out)
        for r in range(TOP_K):
            g, u = (torch.einsum("th,tnh->tn", h.double(), gate_up[experts[:, r]].double())).chunk(2, dim=1)
            act = g / (1 + torch.exp(-g)) * u
            reference += weights[:, r, None].double() * torch.einsum(
                "ti,thi->th", act, down[experts[:, r]].double()
            )
        error = float((out - reference).norm() / reference.norm())
        assert error < 1e-2, f"{mode}, {tokens} tokens: relative error {error}"


@pytest.mark.gpu
def test_on_a_gpu_a_tokens_experts_give_it_the_same_bits_whatever_the_step_around_it(triton_ops: Any) -> None:
    generator = torch.Generator(device="cuda").manual_seed(2)
    gate_up, down = gpu_layer(generator)
    kernels = triton_ops.TritonKernels()
    h = torch.randn(512, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
    experts, weights = step_routing(generator, 512, skew=True)
    whole = kernels.expert_mlp(h, gate_up, down, experts, weights)
    assert torch.isfinite(whole.float()).all()
    # Alone, a few, a decode batch, rows shifted: every expert gets another count each time.
    for rows in ([0], [511], [7, 8], list(range(100, 228)), list(range(3, 512, 5)), list(range(1, 512))):
        part = kernels.expert_mlp(h[rows], gate_up, down, experts[rows], weights[rows])
        assert torch.equal(part, whole[rows]), (
            f"rows {rows[:3]}... (of {len(rows)}): other bits than amid 512"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_on_a_gpu_a_captured_expert_step_replays_whatever_the_tokens_choose(
    triton_ops: Any, mode: str
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(3)
    gate_up, down = gpu_layer(generator)
    kernels = triton_ops.TritonKernels() if mode == "batch_invariant" else triton_ops.CublasKernels()
    tokens = 24
    h = torch.randn(tokens, HIDDEN, generator=generator, device="cuda").to(torch.bfloat16)
    experts, weights = step_routing(generator, tokens, skew=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.expert_mlp(h, gate_up, down, experts, weights)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.expert_mlp(h, gate_up, down, experts, weights)
    for skew in (True, False):
        h.copy_(torch.randn(tokens, HIDDEN, generator=generator, device="cuda"))
        new_experts, new_weights = step_routing(generator, tokens, skew)
        experts.copy_(new_experts)
        weights.copy_(new_weights)
        graph.replay()
        eager = kernels.expert_mlp(h, gate_up, down, experts, weights)
        assert torch.equal(captured, eager), f"{mode}: the replay differs from the eager step (skew {skew})"


@pytest.mark.gpu
def test_on_a_gpu_one_launch_routing_chooses_what_route_does(triton_ops: Any) -> None:
    from pinned_backend.routing import route

    generator = torch.Generator(device="cuda").manual_seed(4)
    kernels = triton_ops.TritonKernels()
    logits = torch.randn(300, EXPERTS, generator=generator, device="cuda").to(torch.bfloat16)
    logits[0] = 0.25  # all tied: the lowest indices win
    chosen, weights = kernels.route(logits, TOP_K, True)
    expected, expected_weights = route(logits, TOP_K, True)
    assert torch.equal(chosen, expected)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    # A row's choice and weights are its own: the same bits in a step of one row.
    for row in (0, 7, 299):
        alone = kernels.route(logits[row : row + 1], TOP_K, True)
        assert torch.equal(alone[0][0], chosen[row]) and torch.equal(alone[1][0], weights[row])
