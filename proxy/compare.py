"""Replay comparison: is a replayed answer bit-identical to the original, and if not, where does it diverge?

Where both answers carry token ids and logprobs, they are compared token by token, logprobs by their bits (a
float's hex form never rounds). One exception: the audit log's canonical JSON (RFC 8785) writes -0.0 as 0, so a
recorded answer cannot tell the two zeros apart, and neither does the comparison. Where the replica gives only text (an upstream API), the
texts are compared character by character, and the result says so. Pure functions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from proxy.answers import Tokens

CONTEXT_TOKENS = 16
CONTEXT_CHARS = 80


@dataclass(frozen=True)
class Comparison:
    outcome: Literal["reproduced", "diverged"]
    compared: Literal["tokens", "text"]
    position: int | None = None  # first divergent token (or character, when compared as text)
    reason: str | None = None  # "token", "logprob", "length" or "text"
    original: str | None = None  # continuations from the divergence on
    replayed: str | None = None
    original_ids: list[int] | None = None
    replayed_ids: list[int] | None = None
    original_logprob: str | None = None  # hex bits of the divergent logprobs
    replayed_logprob: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def compare(original: Tokens, replayed: Tokens) -> Comparison:
    if original.token_ids is not None and replayed.token_ids is not None:
        return _compare_tokens(original, replayed)
    return _compare_text(original.text, replayed.text)


def _compare_tokens(original: Tokens, replayed: Tokens) -> Comparison:
    a_ids, b_ids = original.token_ids or [], replayed.token_ids or []
    a_lp, b_lp = original.token_logprobs or [], replayed.token_logprobs or []
    for k in range(max(len(a_ids), len(b_ids))):
        if k >= len(a_ids) or k >= len(b_ids):
            return _diverged_tokens(original, replayed, k, "length")
        if a_ids[k] != b_ids[k]:
            return _diverged_tokens(original, replayed, k, "token")
        a_bits = _bits(a_lp[k]) if k < len(a_lp) else None
        b_bits = _bits(b_lp[k]) if k < len(b_lp) else None
        if a_bits != b_bits:
            return _diverged_tokens(original, replayed, k, "logprob", a_bits, b_bits)
    if original.text != replayed.text:
        # Same tokens, other text: the detokenizer or stop handling changed, which is divergence too.
        return _compare_text(original.text, replayed.text)
    return Comparison("reproduced", "tokens")


def _bits(logprob: float) -> str:
    return (float(logprob) + 0.0).hex()  # + 0.0 turns -0.0 into 0.0 and leaves every other value alone


def _diverged_tokens(
    original: Tokens,
    replayed: Tokens,
    k: int,
    reason: str,
    a_bits: str | None = None,
    b_bits: str | None = None,
) -> Comparison:
    char = _first_difference(original.text, replayed.text)
    return Comparison(
        "diverged",
        "tokens",
        position=k,
        reason=reason,
        original=original.text[char : char + CONTEXT_CHARS],
        replayed=replayed.text[char : char + CONTEXT_CHARS],
        original_ids=(original.token_ids or [])[k : k + CONTEXT_TOKENS],
        replayed_ids=(replayed.token_ids or [])[k : k + CONTEXT_TOKENS],
        original_logprob=a_bits,
        replayed_logprob=b_bits,
    )


def _compare_text(a: str, b: str) -> Comparison:
    if a == b:
        return Comparison("reproduced", "text")
    k = _first_difference(a, b)
    return Comparison(
        "diverged",
        "text",
        position=k,
        reason="text",
        original=a[k : k + CONTEXT_CHARS],
        replayed=b[k : k + CONTEXT_CHARS],
    )


def _first_difference(a: str, b: str) -> int:
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return min(len(a), len(b))
