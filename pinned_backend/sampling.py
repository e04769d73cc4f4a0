"""Choosing the next token from one row of logits, reproducibly.

A request's randomness is a pure function of its seed and the token's position in the completion: each draw
takes one uniform number from a counter-based hash of `(seed, position)`, never from a shared generator, so
neither the batch a request shares nor the order in which the engine visits its rows can change what it
samples. Every function here works on a single row, so the result never depends on the shape of a batch
either.

This module knows nothing of scheduling, caches or HTTP; the engine calls it once per sampled token, and the
caller supplies the randomness used to draw a seed when a request has none.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` mean off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.temperature > 0 and self.seed is None:
            raise ValueError("sampling with temperature > 0 needs a seed; draw one with draw_seed()")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def draw_seed(rng: random.Random) -> int:
    """A fresh seed for a request that sent none, reported back so that its answer can be replayed.

    Below 2**53, so that every JSON reader (JavaScript's included) and the audit log's canonical JSON carry it
    exactly.
    """
    return rng.randrange(2**53)


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on `seed` and `position`."""
    digest = hashlib.sha256(f"stackpin-sample:{seed}:{position}".encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) * 2.0**-53


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token to emit at `position` of the completion, from this row's logits `[V]`."""
    if logits.dim() != 1:
        raise ValueError(f"sample_token takes one row of logits [V], got shape {tuple(logits.shape)}")
    if params.greedy:
        # torch.argmax returns the first of equal maxima, so ties break towards the lower id.
        return int(torch.argmax(logits))
    assert params.seed is not None
    # float64 and a stable sort: the choice is the same function of the logits on every run.
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True, stable=True)
    ranked = probs[order]
    keep = ranked.numel()
    if params.top_k:
        keep = min(keep, params.top_k)
    if params.top_p < 1:
        cumulative = torch.cumsum(ranked[:keep], dim=0)
        # The smallest prefix whose mass reaches top_p.
        keep = min(keep, int((cumulative < params.top_p).sum()) + 1)
    cdf = torch.cumsum(ranked[:keep], dim=0)
    target = position_uniform(params.seed, position) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    index = min(index, keep - 1)
    return int(order[index])


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely tokens of one row of log-probabilities `[V]`, best first, ties by lower id."""
    if k == 0:
        return ()
    order = torch.argsort(logprobs, descending=True, stable=True)[:k]
    return tuple((int(i), float(logprobs[i])) for i in order)
