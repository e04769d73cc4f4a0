"""Specification of pinned_backend.routing: dropless routing depends on a token's own logits alone, with a stated
tie rule; a capacity factor makes it depend on the rest of the step, in the two ways real implementations do."""

from __future__ import annotations

import pytest
import torch

from pinned_backend.routing import (
    DROPPED,
    ExpertRouting,
    _grant,
    _pass_through_ranks,
    expert_capacity,
    route,
    sum_by_rank,
)


def test_ties_go_to_the_lower_expert_index() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]])
    experts, _ = route(logits, 3, norm_topk_prob=False)
    assert experts.tolist() == [[1, 3, 4], [0, 1, 2]]


def test_top_k_weights_are_the_softmax_probabilities_renormalised_when_asked() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, -1)
    experts, raw = route(logits, 2, norm_topk_prob=False)
    values, indices = torch.topk(probs, 2)
    assert torch.equal(experts, indices) and torch.equal(raw, values)
    _, normed = route(logits, 2, norm_topk_prob=True)
    assert torch.equal(normed, values / (values[:, 0] + values[:, 1])[:, None])
    torch.testing.assert_close(normed.sum(-1), torch.ones(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropless_routing_of_a_token_does_not_depend_on_the_tokens_around_it(dtype: torch.dtype) -> None:
    logits = (torch.randn(300, 128, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    experts, weights = route(logits, 8, norm_topk_prob=True)
    for start, length in ((0, 1), (7, 1), (5, 2), (13, 17), (100, 200)):
        part_experts, part_weights = route(logits[start : start + length], 8, norm_topk_prob=True)
        assert torch.equal(part_experts, experts[start : start + length])
        assert torch.equal(part_weights, weights[start : start + length]), (
            f"rows {start}..{start + length} routed alone got other weight bits than amid all 300 rows"
        )


def test_sum_by_rank_adds_left_to_right() -> None:
    values = torch.tensor([[1e8, 1.0, -1e8, 1.0]], dtype=torch.float32)
    # ((1e8 + 1) - 1e8) + 1 in float32: the first 1 is lost to rounding, the last is not.
    assert sum_by_rank(values).item() == 1.0


def test_capacity_is_the_factor_times_the_steps_share_of_assignments_per_expert() -> None:
    assert expert_capacity(tokens=10, top_k=2, num_experts=8, factor=1.0) == 3
    assert expert_capacity(tokens=1, top_k=8, num_experts=128, factor=1.25) == 1
    assert expert_capacity(tokens=64, top_k=8, num_experts=128, factor=2.0) == 8


def crowding_logits(tokens: int) -> torch.Tensor:
    # Every token ranks the experts 0 > 1 > 2 > 3: their first choice collides.
    return torch.tensor([[4.0, 3.0, 2.0, 1.0]]).repeat(tokens, 1)


def test_pass_through_refuses_an_assignment_once_its_expert_is_full() -> None:
    routing = ExpertRouting(capacity_factor=1.0, overflow="pass_through")  # capacity ceil(4 * 1 / 4) = 1
    experts, weights = route(crowding_logits(4), 1, norm_topk_prob=False, routing=routing)
    assert experts[:, 0].tolist() == [0, DROPPED, DROPPED, DROPPED]
    assert weights[1:].eq(0).all() and weights[0, 0] > 0


def test_next_expert_reroutes_an_overflowing_assignment_down_the_tokens_ranking() -> None:
    routing = ExpertRouting(capacity_factor=1.0, overflow="next_expert")
    experts, weights = route(crowding_logits(4), 1, norm_topk_prob=False, routing=routing)
    assert experts[:, 0].tolist() == [0, 1, 2, 3]
    assert torch.equal(weights[:, 0], torch.softmax(crowding_logits(1), -1)[0])


def test_first_choices_are_granted_before_second_choices_and_a_token_never_takes_one_expert_twice() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 4.0, 3.0, 2.0]])
    routing = ExpertRouting(capacity_factor=1.0, overflow="next_expert")  # capacity ceil(2 * 2 / 4) = 1
    experts, _ = route(logits, 2, norm_topk_prob=False, routing=routing)
    # Token 0's second choice (expert 1) was token 1's first: token 1 keeps it, token 0 moves on to expert 2;
    # token 1's second choice (expert 2) is then full, and it moves on to expert 3.
    assert experts.tolist() == [[0, 2], [1, 3]]


def test_with_a_capacity_factor_a_tokens_experts_depend_on_the_batch() -> None:
    target = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    routing = ExpertRouting(capacity_factor=1.0, overflow="pass_through")
    alone, _ = route(target, 1, norm_topk_prob=False, routing=routing)
    crowded, _ = route(torch.cat([crowding_logits(3), target]), 1, norm_topk_prob=False, routing=routing)
    assert alone.tolist() == [[0]] and crowded[-1].tolist() == [DROPPED]
    dropless, _ = route(torch.cat([crowding_logits(3), target]), 1, norm_topk_prob=False)
    assert dropless[-1].tolist() == [0]


def test_the_routing_describes_itself_for_the_stack() -> None:
    assert ExpertRouting().describe() == {"policy": "dropless"}
    assert ExpertRouting(1.25, "next_expert").describe() == {
        "policy": "capacity",
        "capacity_factor": 1.25,
        "overflow": "next_expert",
    }


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_a_capacity_factor_must_be_a_positive_number(factor: float) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        ExpertRouting(capacity_factor=factor)


def test_an_unknown_overflow_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="choose one of pass_through, next_expert"):
        ExpertRouting(capacity_factor=1.0, overflow="drop")  # type: ignore[arg-type]


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_pass_through_in_tensor_ops_grants_what_the_turn_by_turn_grant_does(factor: float) -> None:
    generator = torch.Generator().manual_seed(int(factor * 10))
    for tokens in (1, 7, 40):
        logits = torch.randn(tokens, 6, generator=generator)
        ranked = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True)[1]
        capacity = expert_capacity(tokens, 3, 6, factor)
        turn_by_turn = _grant(ranked.tolist(), 3, capacity, "pass_through")
        assert _pass_through_ranks(ranked[:, :3], capacity).reshape(-1).tolist() == turn_by_turn
