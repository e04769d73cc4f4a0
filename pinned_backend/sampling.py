"""Choosing the next token from one row of logits, reproducibly.

A request's randomness is a pure function of its seed and the token's position in the completion: each draw
takes one uniform number from a counter-based hash of `(seed, position)`, never from a shared generator, so
neither the batch a request shares nor the order in which the engine visits its rows can change what it
samples. Every function here treats each row alone (the batched one only saves transfers), so the result never
depends on the shape of a batch either.

A speculative verify pass hands `draw_runs` a run of one sequence's rows: row i draws the token at position
`position + i` of the completion exactly as a plain decode step there would, and the run stops at the first draw
that is not the draft fed after it. So a kept draft is always the very token the sampler draws at its position,
and seeded sampling gives the same answer with speculation on or off.

A constrained request's rows arrive masked (masks.py: -inf wherever its grammar allows no token), so what is drawn
here, and every log-probability reported, is the masked distribution's; a ruled-out token never appears among the
top log-probabilities.

This module knows nothing of scheduling, caches or HTTP; the engine calls it once per step, and the caller supplies
the randomness used to draw a seed when a request has none.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pinned_backend.grammar import CompiledGrammar

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
    # The grammar the output must follow (grammar.py), or none; the engine masks the rows this request draws from.
    grammar: CompiledGrammar | None = None

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
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    if not params.top_k and params.top_p >= 1:
        # Every token is kept, so no ranking is needed: walk them in id order.
        order, ranked = torch.arange(probs.numel()), probs
    else:
        order, ranked = _ranked_prefix(probs, params.top_k, params.top_p)
    cdf = torch.cumsum(ranked, dim=0)
    target = position_uniform(params.seed, position) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64), right=True))
    return int(order[min(index, order.numel() - 1)])


def _ranked_prefix(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top_k and top_p keep, most likely first, ties by lower id: (ids, their probabilities)."""
    limit = top_k or probs.numel()
    # Rank only the few most likely tokens; widen until they hold top_p's mass or top_k's count.
    width = min(limit, 64)
    while True:
        order, ranked = _top(probs, width)
        cumulative = torch.cumsum(ranked, dim=0)
        reaches = int((cumulative < top_p).sum()) + 1 if top_p < 1 else width + 1
        if reaches <= width or width >= limit:
            keep = min(reaches, width)
            return order[:keep], ranked[:keep]
        width = min(limit, width * 8)


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest of `values [V]`, largest first, ties by lower index, whatever topk does with ties."""
    k = min(k, values.numel())
    threshold = torch.topk(values, k).values[-1]
    candidates = torch.nonzero(values >= threshold).squeeze(1)  # in index order
    order = candidates[torch.argsort(values[candidates], descending=True, stable=True)][:k]
    return order, values[order]


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely tokens of one row of log-probabilities `[V]`, best first, ties by lower id; never a token a
    grammar's mask ruled out (its log-probability is -inf)."""
    if k == 0:
        return ()
    order, values = _top(logprobs, k)
    return tuple((int(i), float(v)) for i, v in zip(order, values, strict=True) if v != -math.inf)


def top_logprobs_rows(logprobs: torch.Tensor, ks: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """`top_logprobs(logprobs[i], ks[i])` for every row of `logprobs [R, V]`, with one transfer to the host.

    On a GPU, one stable descending sort of the rows that ask for any (stable: equal values keep index order, so
    ties go to the lower id, as `top_logprobs` breaks them); on the CPU, row by row, where a partial selection
    beats sorting a large vocabulary."""
    if logprobs.device.type == "cpu" or not any(ks):
        return [top_logprobs(logprobs[i], k) for i, k in enumerate(ks)]
    return sorted_top_logprobs(logprobs, ks)


def sorted_top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[tuple[tuple[int, float], ...]]:
    """`top_logprobs_rows` by one stable sort, on any device."""
    wanted = [i for i, k in enumerate(ks) if k]
    width = max(ks)
    values, ids = torch.sort(logprobs[wanted], dim=-1, descending=True, stable=True)
    values, ids = values[:, :width].cpu().tolist(), ids[:, :width].cpu().tolist()
    out: list[tuple[tuple[int, float], ...]] = [() for _ in ks]
    for j, i in enumerate(wanted):
        out[i] = tuple(
            (t, v) for t, v in zip(ids[j][: ks[i]], values[j][: ks[i]], strict=True) if v != -math.inf
        )
    return out


@dataclass(frozen=True)
class Drawn:
    """A token drawn at one position, its log-probability, and the top log-probabilities asked for."""

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RowRun:
    """One sequence's logits rows `first` .. `first + count - 1`, drawing the completion's positions `position` on;
    `drafts[i]` is the token fed after row i's (a verify pass; empty for a single row)."""

    params: SamplingParams
    position: int
    first: int
    count: int
    drafts: Sequence[int] = ()


def draw_runs(
    logits: torch.Tensor, runs: Sequence[RowRun], log_softmax: Callable[[torch.Tensor], torch.Tensor]
) -> list[list[Drawn]]:
    """What each run of rows of `logits [R, V]` draws: its tokens up to the first that is not the next draft.

    Greedy rows take the argmax where the logits are (torch.argmax returns the first of equal maxima on every device,
    as `sample_token` does), so a GPU step moves a few numbers to the host, not whole rows of the vocabulary; only
    rows that draw at random bring their logits to the CPU's float64 sampler. `log_softmax` is the kernels' own,
    which treats each row alone, so dropping the rows after a rejected draft changes no kept row's bits."""
    argmax = torch.argmax(logits, dim=-1).tolist()
    random_rows = [run.first + i for run in runs if not run.params.greedy for i in range(run.count)]
    host: dict[int, torch.Tensor] = {}
    if random_rows:
        moved = logits[torch.tensor(random_rows, device=logits.device)].float().cpu()
        host = {row: moved[j] for j, row in enumerate(random_rows)}
    kept: list[int] = []  # the logits rows whose tokens are drawn
    tokens: list[int] = []
    spans = []  # each run's start in `kept` and its count
    for run in runs:
        start = len(kept)
        for i in range(run.count):
            row = run.first + i
            token = (
                argmax[row] if run.params.greedy else sample_token(host[row], run.params, run.position + i)
            )
            kept.append(row)
            tokens.append(token)
            if i == run.count - 1 or token != run.drafts[i]:
                break
        spans.append((start, len(kept) - start))
    if len(kept) < logits.shape[0]:
        logits = logits[torch.tensor(kept, device=logits.device)]
    logprobs = log_softmax(logits).float()  # [len(kept), V]
    index = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    ks = [run.params.top_logprobs for run, (_, count) in zip(runs, spans, strict=True) for _ in range(count)]
    tops = top_logprobs_rows(logprobs, ks)
    return [[Drawn(tokens[j], chosen[j], tops[j]) for j in range(start, start + n)] for start, n in spans]
