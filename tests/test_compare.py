"""Replay comparison: bit-identical tokens and logprobs, or the first divergent position and why."""

from __future__ import annotations

from proxy.answers import Tokens
from proxy.compare import compare


def tokens(ids: list[int], logprobs: list[float], text: str = "a b c") -> Tokens:
    return Tokens(text=text, token_ids=ids, token_logprobs=logprobs)


def test_identical_tokens_and_bits_reproduce() -> None:
    assert (
        compare(tokens([1, 2, 3], [-0.5, -1.0, -2.0]), tokens([1, 2, 3], [-0.5, -1.0, -2.0])).outcome
        == "reproduced"
    )


def test_a_last_bit_difference_in_a_logprob_is_divergence() -> None:
    nudged = -1.0000000000000002
    result = compare(tokens([1, 2, 3], [-0.5, -1.0, -2.0]), tokens([1, 2, 3], [-0.5, nudged, -2.0]))
    assert (result.outcome, result.position, result.reason) == ("diverged", 1, "logprob")
    assert result.original_logprob == (-1.0).hex()


def test_the_two_zeros_are_one_because_the_canonical_record_cannot_keep_them_apart() -> None:
    assert compare(tokens([1], [0.0]), tokens([1], [-0.0])).outcome == "reproduced"


def test_a_logprob_read_back_as_an_integer_compares_as_its_float() -> None:
    assert compare(tokens([1], [-1]), tokens([1], [-1.0])).outcome == "reproduced"


def test_a_different_token_and_a_shorter_answer() -> None:
    result = compare(tokens([1, 2, 3], [0.0] * 3, "a b c"), tokens([1, 9, 3], [0.0] * 3, "a z c"))
    assert (result.position, result.reason, result.original, result.replayed) == (1, "token", "b c", "z c")
    assert compare(tokens([1, 2], [0.0] * 2), tokens([1, 2, 3], [0.0] * 3)).reason == "length"


def test_without_token_ids_the_text_is_compared_and_said_so() -> None:
    result = compare(Tokens(text="hello world"), Tokens(text="hello there"))
    assert (result.outcome, result.compared, result.position) == ("diverged", "text", 6)
    assert compare(Tokens(text="same"), Tokens(text="same")).compared == "text"
