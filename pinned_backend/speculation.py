"""Draft tokens by prompt lookup: guess a request's next tokens from its own prompt and output.

When the last few tokens of a sequence (an n-gram, the longest of `MAX_NGRAM` down to `MIN_NGRAM` that occurred
before) appeared earlier in it, the tokens that followed that earlier occurrence are offered as drafts: a request
that edits, quotes or summarises a text it was given tends to copy runs of it. No second model is needed. The
most recent earlier occurrence wins, since text being copied sits nearest; where its continuation reaches the
sequence's end, the copy overlaps itself and repeats (as an LZ77 copy does), which is what a repeating output will
write next.

Drafts are guesses and never change an answer: the engine feeds them with the sequence's last token in one step
and keeps a draft only when it is the very token the sampler draws at its position (engine.py says why those bits
are the ones a plain decode step would give). This module knows nothing of models, sampling or scheduling; it
keeps, per sequence, where each n-gram last ended, up to date as tokens are appended, so drafting costs a few
dictionary lookups a step, not a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 3
MIN_NGRAM = 1


class PromptLookup:
    """One sequence's tokens and the index of its n-grams."""

    def __init__(self, tokens: Sequence[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = list(tokens)
        # n-gram -> index just past its latest occurrence that has a continuation (so never the sequence's suffix)
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in `_next`

    def append(self, token: int) -> None:
        self.tokens.append(token)

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram; [] if none."""
        tokens = self.tokens
        end = len(tokens)
        # An n-gram ending at index e < end - 1 has a known continuation from e + 1 on.
        for e in range(self._indexed, end - 1):
            for n in range(self.min_ngram, min(self.max_ngram, e + 1) + 1):
                self._next[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        self._indexed = max(self._indexed, end - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self._next.get(tuple(tokens[end - n :]))
            if start is not None:
                # The match says the text repeats every `end - start` tokens; a copy that runs into the drafts
                # themselves goes on repeating (an overlapping copy), so a short cycle still fills k drafts.
                period = end - start
                return [tokens[start + i % period] for i in range(k)]
        return []
