"""A replay's token-level diff as the page shows it: the common prefix, the first divergent token with both
continuations, and the logprob bits side by side where only bits differ.

Where the answers diverge is the replay comparison's to say (`proxy/evidence/compare.py`, stored with the replay's record);
this module only lays out the two answers around that position. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from proxy.evidence.answers import Tokens
from proxy.evidence.compare import place
from proxy.ui.answer import bits

PREFIX_SHOWN = 48  # common tokens shown before the divergence; the rest are counted
TAIL_SHOWN = 24  # tokens of each continuation
BITS_SHOWN = 32  # rows of the bits table

State = Literal["same", "diverged", "after"]


@dataclass(frozen=True)
class Cell:
    position: int
    token_id: int
    piece: str | None
    state: State


@dataclass(frozen=True)
class Digit:
    char: str
    differs: bool


@dataclass(frozen=True)
class BitsRow:
    position: int
    token_id: int
    piece: str | None
    original: float
    replayed: float
    original_bits: list[Digit]
    replayed_bits: list[Digit]


@dataclass(frozen=True)
class Side:
    """One answer as the diff needs it: its tokens, and each token's text where the answer carries it."""

    tokens: Tokens
    pieces: list[str | None] = field(default_factory=list)

    def piece(self, k: int) -> str | None:
        return self.pieces[k] if k < len(self.pieces) else None


@dataclass(frozen=True)
class ReplayDiff:
    outcome: str
    compared: str  # "tokens", or "answer" ("text" in replays recorded before) where the replica gives no ids
    unit: str  # where the position counts: "token", or e.g. "choice 1, field message.content, character"
    position: int | None
    reason: str | None
    identical_tokens: int  # tokens identical in id and logprob bits before the divergence (or in all)
    prefix: list[Cell]
    prefix_hidden: int
    original_tail: list[Cell]
    replayed_tail: list[Cell]
    text_prefix: str
    original_text: str  # each continuation's text from the first differing character
    replayed_text: str
    bits_rows: list[BitsRow]


def replay_diff(comparison: dict[str, Any], original: Side, replayed: Side) -> ReplayDiff:
    a, b = original.tokens, replayed.tokens
    k = comparison.get("position")
    compared = comparison.get("compared", "tokens")
    # A replay compared by tokens may still diverge elsewhere (a later choice, a tool call, an event) with every
    # token identical; only a divergence in the tokens themselves is laid out token by token.
    at_token = compared == "tokens" and comparison.get("field") in (None, "tokens") and k is not None
    char = next((j for j, (x, y) in enumerate(zip(a.text, b.text, strict=False)) if x != y), None)
    char = min(len(a.text), len(b.text)) if char is None else char
    ids = a.token_ids or []
    if comparison.get("outcome") == "reproduced" or not at_token:
        k_tokens = len(ids) if compared == "tokens" else 0
    else:
        k_tokens = k
    shown_from = max(0, k_tokens - PREFIX_SHOWN) if compared == "tokens" else k_tokens
    unit, _ = place(comparison) if comparison.get("outcome") == "diverged" else ("token", None)
    return ReplayDiff(
        outcome=str(comparison.get("outcome")),
        compared=compared,
        unit=unit,
        position=k,
        reason=comparison.get("reason"),
        identical_tokens=k_tokens if compared == "tokens" else 0,
        prefix=[_cell(original, j, "same") for j in range(shown_from, min(k_tokens, len(ids)))],
        prefix_hidden=shown_from,
        original_tail=_tail(original, replayed, k_tokens) if at_token else [],
        replayed_tail=_tail(replayed, original, k_tokens) if at_token else [],
        text_prefix=a.text[:char],
        original_text=a.text[char:],
        replayed_text=b.text[char:],
        bits_rows=_bits_rows(original, replayed, k_tokens) if at_token else [],
    )


def _cell(side: Side, k: int, state: State) -> Cell:
    return Cell(k, (side.tokens.token_ids or [])[k], side.piece(k), state)


def _tail(side: Side, other: Side, k: int) -> list[Cell]:
    """From the divergence on: the divergent token, then each token marked where the other answer has another."""
    ids, others = side.tokens.token_ids or [], other.tokens.token_ids or []
    cells = []
    for j in range(k, min(len(ids), k + TAIL_SHOWN)):
        state: State = (
            "diverged" if j == k else ("same" if j < len(others) and others[j] == ids[j] else "after")
        )
        cells.append(_cell(side, j, state))
    return cells


def _bits_rows(original: Side, replayed: Side, k: int) -> list[BitsRow]:
    """From the divergence on, the tokens both answers share whose logprob bits differ."""
    a, b = original.tokens, replayed.tokens
    a_ids, b_ids = a.token_ids or [], b.token_ids or []
    a_lp, b_lp = a.token_logprobs or [], b.token_logprobs or []
    rows: list[BitsRow] = []
    for j in range(k, min(len(a_ids), len(b_ids), len(a_lp), len(b_lp))):
        if a_ids[j] != b_ids[j]:
            break  # past a token divergence the positions no longer correspond
        x, y = bits(a_lp[j]), bits(b_lp[j])
        if x != y:
            rows.append(
                BitsRow(j, a_ids[j], original.piece(j), a_lp[j], b_lp[j], _digits(x, y), _digits(y, x))
            )
            if len(rows) == BITS_SHOWN:
                break
    return rows


def _digits(own: str, other: str) -> list[Digit]:
    return [Digit(c, j >= len(other) or other[j] != c) for j, c in enumerate(own)]
