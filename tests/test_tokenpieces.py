"""Specification of pinned_backend.tokenpieces: a token's text alone, and its exact bytes."""

from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from pinned_backend.tokenpieces import TokenPieces


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    # "é" is two bytes, C3 A9, spelled "Ã" and "©" in the byte-level alphabet; one token holds each byte.
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|end|>"])
    return tokenizer


def pieces_of(tokenizer: tokenizers.Tokenizer) -> TokenPieces:
    return TokenPieces(
        lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False), tokenizer.id_to_token
    )


def test_half_a_character_keeps_its_real_byte() -> None:
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode("é").ids
    assert len(ids) == 2
    pieces = pieces_of(tokenizer)
    first, second = pieces.piece(ids[0]), pieces.piece(ids[1])
    assert first == ("\ufffd", b"\xc3")
    assert second == ("\ufffd", b"\xa9")
    assert (first[1] + second[1]).decode() == "é"


def test_whole_characters_and_special_tokens_read_as_decoded() -> None:
    tokenizer = byte_level_tokenizer()
    pieces = pieces_of(tokenizer)
    space = tokenizer.encode(" ").ids[0]
    assert pieces.piece(space) == (" ", b" ")
    end = tokenizer.token_to_id("<|end|>")
    assert pieces.piece(end) == ("<|end|>", b"<|end|>")


def test_other_vocabularies_fall_back_to_the_decoded_text() -> None:
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocab={"▁hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.decoder = decoders.Metaspace()
    assert pieces_of(tokenizer).piece(0) == ("hello", b"hello")
