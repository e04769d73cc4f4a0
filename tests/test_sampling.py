"""Specification of pinned_backend.sampling: greedy, seeded, top-k, top-p, per-position randomness."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pinned_backend.sampling import (
    RowRun,
    SamplingParams,
    draw_runs,
    draw_seed,
    position_uniform,
    sample_token,
    sorted_top_logprobs,
    top_logprobs,
    top_logprobs_rows,
)


def _logits(seed: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_takes_the_argmax_and_breaks_ties_towards_the_lower_id() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert sample_token(logits, SamplingParams(temperature=0), position=0) == 1


def test_seeded_sampling_depends_only_on_seed_and_position() -> None:
    logits = _logits(0)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample_token(logits, params, p) for p in range(40)]
    # Interleave draws of other requests: a shared generator would shift; ours must not.
    again = []
    for p in range(40):
        sample_token(logits, SamplingParams(temperature=0.7, seed=99), p)
        again.append(sample_token(logits, params, p))
    assert first == again, "Same seed and position must give the same token whatever else was sampled."
    other = [sample_token(logits, SamplingParams(temperature=1.0, seed=1235), p) for p in range(40)]
    assert first != other, "A different seed should give a different sequence of draws."


def test_position_uniform_is_in_unit_interval_and_spread() -> None:
    values = [position_uniform(7, p) for p in range(2000)]
    assert all(0 <= v < 1 for v in values)
    assert 0.45 < sum(values) / len(values) < 0.55


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    params = SamplingParams(temperature=1.0, seed=5)
    counts = [0, 0, 0]
    for p in range(3000):
        counts[sample_token(logits, params, p)] += 1
    assert abs(counts[0] / 3000 - 0.5) < 0.04
    assert abs(counts[1] / 3000 - 0.3) < 0.04


def test_top_k_keeps_only_the_k_most_likely() -> None:
    logits = _logits(1)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    params = SamplingParams(temperature=2.0, top_k=3, seed=3)
    assert {sample_token(logits, params, p) for p in range(300)} <= allowed


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.6, 0.25, 0.1, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=11)
    seen = {sample_token(logits, params, p) for p in range(500)}
    assert seen == {0, 1}


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(2)
    params = SamplingParams(temperature=1.0, top_p=1e-9, seed=8)
    assert {sample_token(logits, params, p) for p in range(50)} == {int(torch.argmax(logits))}


@given(seed=st.integers(min_value=-(2**70), max_value=2**70), position=st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_any_integer_seed_is_accepted(seed: int, position: int) -> None:
    token = sample_token(_logits(3), SamplingParams(temperature=1.0, seed=seed), position)
    assert 0 <= token < 50


def test_draw_seed_comes_from_the_given_randomness() -> None:
    assert draw_seed(random.Random(1)) == draw_seed(random.Random(1))
    assert 0 <= draw_seed(random.Random(2)) < 2**63


def test_top_logprobs_are_sorted_and_tie_break_by_id() -> None:
    row = torch.tensor([-1.0, -0.5, -0.5, -3.0])
    assert top_logprobs(row, 3) == ((1, -0.5), (2, -0.5), (0, -1.0))
    assert top_logprobs(row, 0) == ()


def test_top_logprobs_of_many_rows_by_one_sort_equal_those_taken_row_by_row() -> None:
    gen = torch.Generator().manual_seed(3)
    # Rounded to a coarse grid, so that rows hold many ties, which both ways must break towards the lower id.
    rows = (torch.randn(12, 3000, generator=gen) * 4).round() / 4
    ks = [0, 1, 5, 20, 3, 0, 7, 20, 2, 1, 0, 9]
    expected = [top_logprobs(rows[i], k) for i, k in enumerate(ks)]
    assert sorted_top_logprobs(rows, ks) == expected
    assert top_logprobs_rows(rows, ks) == expected
    assert top_logprobs_rows(rows, [0] * 12) == [()] * 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop": ("",)}, "stop"),
        ({"temperature": 1.0}, "seed"),
    ],
)
def test_bad_params_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"temperature": 0.0}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{**base, **kwargs})  # type: ignore[arg-type]


def test_sampling_rejects_a_batch_of_logits() -> None:
    with pytest.raises(ValueError, match="one row"):
        sample_token(torch.zeros(2, 5), SamplingParams(temperature=0), 0)


def reference_sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The definition, spelled out: rank every token (ties by id), cut by top_k then top_p, walk the cdf."""
    assert params.seed is not None
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if not params.top_k and params.top_p >= 1:
        order = torch.arange(probs.numel())
    else:
        order = torch.argsort(probs, descending=True, stable=True)
        if params.top_k:
            order = order[: params.top_k]
        if params.top_p < 1:
            mass = torch.cumsum(probs[order], dim=0)
            order = order[: int((mass < params.top_p).sum()) + 1]
    cdf = torch.cumsum(probs[order], dim=0)
    target = position_uniform(params.seed, position) * float(cdf[-1])
    return int(order[min(int((cdf <= target).sum()), order.numel() - 1)])


@given(
    seed=st.integers(0, 2**32),
    top_k=st.sampled_from([0, 1, 5, 100, 5000]),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5]),
    scale=st.sampled_from([0.5, 3.0, 10.0]),
)
@settings(max_examples=40, deadline=None)
def test_sampling_matches_its_definition_on_a_large_vocabulary(
    seed: int, top_k: int, top_p: float, scale: float
) -> None:
    generator = torch.Generator().manual_seed(seed)
    # Rounded logits make many exact ties, which the ranking must break by id.
    logits = (torch.randn(20_000, generator=generator) * scale).round(decimals=1)
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, seed=seed)
    for position in range(5):
        assert sample_token(logits, params, position) == reference_sample(logits, params, position)


def test_a_run_of_rows_draws_each_position_as_a_single_row_would_until_a_draft_is_refused() -> None:
    logits = torch.stack([_logits(s, 12) for s in range(5)])
    seeded = SamplingParams(temperature=1.0, seed=5, top_logprobs=2)
    alone = [sample_token(logits[i], seeded, 7 + i) for i in range(4)]
    # Drafts that agree with the first two draws and not the third: three tokens are drawn, the last the refusal's.
    drafts = [alone[0], alone[1], (alone[2] + 1) % 12]
    runs = [RowRun(seeded, 7, 0, 4, drafts), RowRun(SamplingParams(temperature=0), 0, 4, 1)]
    seeded_run, greedy_run = draw_runs(logits, runs, lambda x: torch.log_softmax(x.float(), dim=-1))
    assert [d.token for d in seeded_run] == alone[:3]
    expected = torch.log_softmax(logits, dim=-1)
    assert [d.logprob for d in seeded_run] == [float(expected[i, t]) for i, t in enumerate(alone[:3])]
    assert all(d.top_logprobs == top_logprobs(expected[i], 2) for i, d in enumerate(seeded_run))
    assert [d.token for d in greedy_run] == [int(torch.argmax(logits[4]))] and greedy_run[
        0
    ].top_logprobs == ()
    every_draft_kept = draw_runs(
        logits[:4], [RowRun(seeded, 7, 0, 4, alone[:3])], lambda x: torch.log_softmax(x, -1)
    )
    assert [d.token for d in every_draft_kept[0]] == alone, "all kept: the last row draws one more"
