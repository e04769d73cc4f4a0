"""Which experts each token of a step goes to, and with what weight: the router's decision, apart from the experts.

Dropless routing (the default) sends every token to its top-k experts whatever else is in the step: the choice and
the weights of a token are functions of its own router logits alone. A router scores its experts one of three ways
(`Scoring`): a softmax over all of them, whose top k are kept (Qwen3-MoE, Mixtral); the top k logits, softmaxed among
themselves (gpt-oss); or sigmoid scores, ranked with a per-expert bias added and only within the `topk_group` groups
whose two best biased scores sum highest, weighted by the unbiased scores (DeepSeek-V3's group-limited routing with
its bias correction). Every softmax runs over a row in float32 (PyTorch's last-dimension softmax reduces a row in one
order however many rows there are); the sigmoid is exp, add and divide; the experts are ranked by a stable descending
sort, so that of two equal scores the lower expert index ranks first; the top-k weights are summed by rank, one
elementwise add at a time, when they are renormalised.

A capacity factor F, opt-in, caps each expert at ceil(F * tokens * k / experts) assignments in a step, as
capacity-limited implementations do. Assignments are granted rank by rank (every token's first choice before any
token's second), in the step's row order; an assignment refused for want of room is either passed through (that
slot contributes nothing, the token's residual carries on) or rerouted to the token's next-ranked expert that has
room and does not already serve it, with that expert's probability as its weight. The cap follows the number of
tokens in the step and the order follows where a token sits in it, so what a token gets depends on the batch: this
is the cause of divergence that dropless routing removes, kept here so that it can be measured (for softmax routers,
the ones it is defined for). This module knows nothing of the experts' matmuls (moe.py) or of the stack beyond
`describe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

OverflowPolicy = Literal["pass_through", "next_expert"]
OVERFLOW_POLICIES: tuple[OverflowPolicy, ...] = ("pass_through", "next_expert")
DROPPED = -1  # the expert index of an assignment that was refused and passed through


@dataclass(frozen=True)
class ExpertRouting:
    """Dropless when `capacity_factor` is None; otherwise capped, with `overflow` deciding what a refusal does."""

    capacity_factor: float | None = None
    overflow: OverflowPolicy = "pass_through"

    def __post_init__(self) -> None:
        if self.capacity_factor is not None and not (
            math.isfinite(self.capacity_factor) and self.capacity_factor > 0
        ):
            raise ValueError(
                f"the expert capacity factor must be a positive number, got {self.capacity_factor}"
            )
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(
                f"unknown overflow policy {self.overflow!r}; choose one of {', '.join(OVERFLOW_POLICIES)}"
            )

    def describe(self) -> dict[str, Any]:
        """The routing as the stack names it: only what changes answers."""
        if self.capacity_factor is None:
            return {"policy": "dropless"}
        return {"policy": "capacity", "capacity_factor": self.capacity_factor, "overflow": self.overflow}


DROPLESS = ExpertRouting()


@dataclass(frozen=True)
class Scoring:
    """How a router's logits rank the experts and weigh the chosen ones (module docstring)."""

    kind: Literal["softmax", "topk_softmax", "sigmoid"] = "softmax"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0  # every weight's factor after any renormalisation (DeepSeek's routed_scaling_factor)


SOFTMAX = Scoring()


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """How many assignments one expert may take in a step of `tokens` tokens."""
    return math.ceil(factor * tokens * top_k / num_experts)


def route(
    logits: torch.Tensor,  # [T, E] the router's logits, any float dtype
    top_k: int,
    norm_topk_prob: bool,
    routing: ExpertRouting = DROPLESS,
    scoring: Scoring = SOFTMAX,
    correction: torch.Tensor | None = None,  # [E] float32: a sigmoid router's bias for choosing
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts [T, k] int64 (by rank; DROPPED where refused) and their weights [T, k] float32."""
    if scoring.kind != "softmax" and routing.capacity_factor is not None:
        raise ValueError(
            f"an expert capacity factor applies to softmax routers, not to {scoring.kind} routing"
        )
    if scoring.kind == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        choice = probs
    elif scoring.kind == "topk_softmax":
        choice = logits.float()
    else:
        probs = 1 / (1 + torch.exp(-logits.float()))
        choice = _best_groups(probs if correction is None else probs + correction, scoring)
    ranked_choice, ranked = torch.sort(choice, dim=-1, descending=True, stable=True)
    if routing.capacity_factor is None:
        experts = ranked[:, :top_k]
        if scoring.kind == "topk_softmax":
            weights = torch.softmax(ranked_choice[:, :top_k], dim=-1)
        else:
            weights = probs.gather(1, experts)
    else:
        ranked_probs = ranked_choice
        capacity = expert_capacity(probs.shape[0], top_k, probs.shape[1], routing.capacity_factor)
        if routing.overflow == "pass_through":
            ranks = _pass_through_ranks(ranked[:, :top_k], capacity)
        else:
            granted = _grant(ranked.tolist(), top_k, capacity, routing.overflow)
            ranks = torch.tensor(granted, dtype=torch.long, device=logits.device).reshape(-1, top_k)
        kept = ranks >= 0
        safe = ranks.clamp(min=0)
        experts = torch.where(kept, ranked.gather(1, safe), DROPPED)
        weights = torch.where(kept, ranked_probs.gather(1, safe), 0.0)
    if norm_topk_prob:
        chosen = weights if routing.capacity_factor is None else ranked_choice[:, :top_k]
        total = sum_by_rank(chosen)
        weights = weights / (total + 1e-20 if scoring.kind == "sigmoid" else total)[:, None]
    if scoring.scale != 1.0:
        weights = weights * scoring.scale
    return experts, weights


def _best_groups(scores: torch.Tensor, scoring: Scoring) -> torch.Tensor:
    """scores [T, E] with every expert outside the token's `topk_group` best groups at -inf; a group's merit is the
    sum of its two best scores, the better first."""
    tokens, experts = scores.shape
    if scoring.n_group == 1:
        return scores
    grouped = scores.view(tokens, scoring.n_group, experts // scoring.n_group)
    best = torch.sort(grouped, dim=-1, descending=True, stable=True).values
    merit = best[..., 0] + best[..., 1]
    chosen = torch.sort(merit, dim=-1, descending=True, stable=True).indices[:, : scoring.topk_group]
    keep = torch.zeros_like(merit, dtype=torch.bool).scatter_(1, chosen, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(tokens, experts)


def _pass_through_ranks(chosen: torch.Tensor, capacity: int) -> torch.Tensor:
    """chosen [T, k] (each token's experts by rank) -> [T, k]: the rank where the assignment was granted, -1 where
    refused. What `_grant` decides for pass_through, in tensor ops on the step's device (no read back to the host):
    granting rank by rank in row order, an assignment is refused exactly when its expert already took `capacity`
    assignments before it in that order, since under pass_through every earlier one was granted while there was
    room."""
    tokens, top_k = chosen.shape
    in_turn = chosen.t().reshape(-1)  # every token's first choice, then every token's second, ...
    sorted_experts, order = torch.sort(in_turn, stable=True)
    run_start = torch.searchsorted(sorted_experts, sorted_experts)
    position = torch.arange(in_turn.shape[0], device=chosen.device) - run_start
    granted = torch.empty_like(position, dtype=torch.bool).scatter_(0, order, position < capacity)
    ranks = torch.arange(top_k, device=chosen.device).expand(tokens, top_k)
    return torch.where(granted.view(top_k, tokens).t(), ranks, -1)


def sum_by_rank(values: torch.Tensor) -> torch.Tensor:
    """values [T, k] -> [T], added left to right: the order of each row's sum is fixed by rank."""
    total = values[:, 0]
    for r in range(1, values.shape[1]):
        total = total + values[:, r]
    return total


def _grant(ranked: list[list[int]], top_k: int, capacity: int, overflow: OverflowPolicy) -> list[int]:
    """For each token's k slots (flattened, token-major), the rank of the expert it got, or -1 if refused."""
    load = [0] * len(ranked[0]) if ranked else []
    taken: list[set[int]] = [set() for _ in ranked]
    granted = [-1] * (len(ranked) * top_k)
    for slot in range(top_k):
        for token, order in enumerate(ranked):
            candidates = [slot] if overflow == "pass_through" else range(slot, len(order))
            for rank in candidates:
                expert = order[rank]
                if expert not in taken[token] and load[expert] < capacity:
                    load[expert] += 1
                    taken[token].add(expert)
                    granted[token * top_k + slot] = rank
                    break
    return granted
