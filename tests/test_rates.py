"""Rates and their spread: the Wilson interval's known values and edges, and a distribution of divergence positions."""

from __future__ import annotations

import pytest

from proxy.evidence.rates import Positions, wilson


def test_the_wilson_interval_matches_its_published_values() -> None:
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81 of 263 -> 0.2553 to 0.3662.
    rate = wilson(81, 263)
    assert (round(rate.low, 4), round(rate.high, 4)) == (0.2553, 0.3662)
    # 15 of 148 -> 0.0624 to 0.1605 (the same table).
    rate = wilson(15, 148)
    assert (round(rate.low, 4), round(rate.high, 4)) == (0.0624, 0.1605)


def test_none_of_n_and_all_of_n_keep_an_interval_that_touches_the_edge_only_on_that_side() -> None:
    none = wilson(0, 20)
    assert none.value == 0 and none.low == 0.0 and 0.15 < none.high < 0.17, "0 of 20 still allows ~16%"
    every = wilson(20, 20)
    assert every.value == 1 and every.high == 1.0 and 0.83 < every.low < 0.85
    assert wilson(0, 200).high < wilson(0, 20).high, "more prompts, a narrower interval"


def test_no_trials_say_nothing_and_impossible_counts_are_refused() -> None:
    assert wilson(0, 0).value is None and (wilson(0, 0).low, wilson(0, 0).high) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson(3, 2)
    assert wilson(1, 4).as_json() == {"hits": 1, "total": 4, "rate": 0.25, "low": wilson(1, 4).low,
                                      "high": wilson(1, 4).high}  # fmt: skip


def test_positions_give_their_histogram_and_quantiles() -> None:
    positions = Positions.of([5, 2, 9, 2, 2, 30])
    assert positions.counts == {2: 3, 5: 1, 9: 1, 30: 1}
    summary = positions.as_json()
    assert (summary["count"], summary["first"], summary["median"], summary["p90"], summary["last"]) == (
        6, 2, 2, 30, 30,
    )  # fmt: skip
    assert summary["histogram"] == [[2, 3], [5, 1], [9, 1], [30, 1]]
    empty = Positions.of([]).as_json()
    assert empty["count"] == 0 and empty["median"] is None and empty["histogram"] == []
