"""How one token reads on its own, for OpenAI's logprobs: its text and its exact bytes.

Decoding a single token of a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen) can give half of a UTF-8
character, which a decoder shows as U+FFFD; OpenAI's `bytes` field carries the token's real bytes instead, so
that a client can join them. Byte-level vocabularies spell each byte as one printable character; mapping a
token's spelling back through that table gives its bytes. The mapping is trusted only where it reproduces what
the tokenizer itself decodes, so other vocabularies (SentencePiece, plain words) fall back to the decoded
text's UTF-8. This module reads a tokenizer and knows nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache


def _byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 table from printable characters back to the bytes they stand for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class TokenPieces:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        spelling: Callable[[int], str | None],
    ) -> None:
        """`decode(ids)` must keep special tokens; `spelling(id)` is the vocabulary's entry for the id."""
        self._decode = decode
        self._spelling = spelling
        self._alphabet = _byte_level_alphabet()
        self.piece = cache(self._piece)

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        text = self._decode([token_id])
        spelled = self._spelling(token_id)
        if spelled and all(c in self._alphabet for c in spelled):
            raw = bytes(self._alphabet[c] for c in spelled)
            if raw.decode("utf-8", errors="replace") == text:
                return text, raw
        return text, text.encode()
