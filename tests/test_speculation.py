"""Specification of prompt lookup (pinned_backend/speculation.py): drafts copied from a sequence's own tokens."""

from __future__ import annotations

import random

import pytest

from pinned_backend.speculation import PromptLookup


def test_the_tokens_after_an_earlier_occurrence_of_the_suffix_are_the_drafts() -> None:
    lookup = PromptLookup([10, 11, 12, 13, 14, 15, 20, 11, 12])
    assert lookup.draft(3) == [13, 14, 15]
    assert lookup.draft(6) == [13, 14, 15, 20, 11, 12]


def test_a_copy_that_runs_into_its_own_drafts_repeats_itself() -> None:
    assert PromptLookup([7, 8, 9, 7, 8, 9]).draft(5) == [7, 8, 9, 7, 8], "a cycle of three"
    assert PromptLookup([1, 5, 5, 5]).draft(3) == [5, 5, 5]
    assert PromptLookup([10, 11, 12, 13, 14, 15, 20, 11, 12]).draft(8) == [13, 14, 15, 20, 11, 12, 13, 14]


def test_the_longest_suffix_n_gram_wins_and_then_its_latest_occurrence() -> None:
    # "2" occurs last before 9, but the 2-gram "1 2" occurred only before 5; the 1-gram "3" twice, latest before 8.
    assert PromptLookup([1, 2, 5, 6, 2, 9, 1, 2]).draft(2) == [5, 6]
    assert PromptLookup([3, 7, 3, 8, 4, 3]).draft(1) == [8]


def test_no_earlier_occurrence_gives_no_drafts() -> None:
    assert PromptLookup([1, 2, 3, 4]).draft(4) == []
    assert PromptLookup([1]).draft(4) == []
    assert PromptLookup([1, 2, 1]).draft(0) == []


def test_appended_tokens_are_indexed_as_they_come() -> None:
    lookup = PromptLookup([4, 5, 6, 7])
    assert lookup.draft(2) == []
    for token in (8, 4, 5):
        lookup.append(token)
    assert lookup.draft(2) == [6, 7]
    lookup.append(6)
    assert lookup.draft(3) == [7, 8, 4]


def test_an_index_kept_up_to_date_drafts_what_a_fresh_one_would() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(6) for _ in range(12)]
    kept = PromptLookup(tokens)
    for _ in range(60):
        k = rng.randint(0, 4)
        assert kept.draft(k) == PromptLookup(tokens).draft(k)
        token = rng.randrange(6)
        tokens.append(token)
        kept.append(token)


def test_n_gram_sizes_must_make_sense() -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookup([1], max_ngram=1, min_ngram=2)
