"""Specification of pinned_backend.masks: one mask per constrained logits row (after each draft in turn, the
matcher rolled back), applied out of place, leaving allowed logits' bits and every other row as they were."""

from __future__ import annotations

import pytest
import torch

from pinned_backend.grammar import GrammarCompiler, regex_grammar
from pinned_backend.masks import MaskRows, StepMasks, unpack
from pinned_backend.tokenizer import Tokenizer
from tests.support.backend_checkpoint import write_random_checkpoint


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = write_random_checkpoint(tmp_path_factory.mktemp("masks") / "bytes", with_tokenizer="bytes")
    return Tokenizer.from_pretrained(folder)


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row != float("-inf")).squeeze(1).tolist())


def test_bit_j_of_word_i_is_token_32i_plus_j() -> None:
    bitmask = torch.tensor([[0b101, 0], [0, -(2**31)]], dtype=torch.int32)
    bits = unpack(bitmask, 70)
    assert bits.shape == (2, 70)
    assert torch.nonzero(bits[0]).squeeze(1).tolist() == [0, 2]
    assert torch.nonzero(bits[1]).squeeze(1).tolist() == [63]
    assert not unpack(bitmask, 80)[:, 64:].any(), "tokens past the mask's end are not allowed"


def test_each_row_of_a_verify_pass_is_masked_after_the_drafts_before_it(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size + 5, tokenizer.eos_token_ids)
    matcher = compiler.compile(regex_grammar("(abc|abd)e")).matcher()
    a, b, c, d, e = ids(tokenizer, "abcde")
    width = tokenizer.vocab_size + 5
    logits = torch.randn(5, width)
    before = logits.clone()
    # Row 0 belongs to an unconstrained sequence; rows 1..3 to one with drafts a, b; row 4 to nobody's mask.
    pending = StepMasks().start([MaskRows(matcher, 1, [a, b])], rows=5)
    assert pending is not None
    masked = pending.apply(logits)
    assert torch.equal(logits, before), "applied out of place"
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[4], logits[4])
    assert [allowed(masked[r]) for r in (1, 2, 3)] == [{a}, {b}, {c, d}]
    kept = masked[3] != float("-inf")
    assert torch.equal(masked[3][kept], logits[3][kept]), "an allowed token keeps its logit's bits"
    assert matcher.valid_prefix([a, b, c, e]) == 4, "the matcher was rolled back past the drafts"


def test_a_finished_grammar_allows_only_the_end_of_sequence(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile(regex_grammar("a")).matcher()
    matcher.commit(ids(tokenizer, "a")[0])
    pending = StepMasks().start([MaskRows(matcher, 0, [])], rows=1)
    assert pending is not None
    assert allowed(pending.apply(torch.zeros(1, tokenizer.vocab_size))[0]) == set(tokenizer.eos_token_ids)


def test_a_step_with_no_constrained_row_has_nothing_to_mask() -> None:
    assert StepMasks().start([], rows=3) is None


def test_many_sequences_in_one_step_each_get_their_own_grammar_s_mask(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matchers = [compiler.compile(regex_grammar(f"{i}+x")).matcher() for i in range(8)]
    pending = StepMasks().start([MaskRows(m, 7 - i, []) for i, m in enumerate(matchers)], rows=8)
    assert pending is not None
    masked = pending.apply(torch.zeros(8, tokenizer.vocab_size))
    assert [allowed(masked[7 - i]) for i in range(8)] == [set(ids(tokenizer, str(i))) for i in range(8)]
