"""A mixture-of-experts MLP layer: the router, then each token's k experts, their outputs weighted and summed.

Which experts a token gets is routing.py's decision; this module runs them, in one of two ways:
- kernels with grouped expert families (`ExpertKernels`: the GPU's, kernels/triton/) route a dropless step in one
  launch (`route`, what routing.py's dropless `route` computes) and take the whole step's experts at once
  (`expert_mlp`): every expert's rows in one launch per GEMM and a sum of each token's k outputs by rank, with
  nothing read back to the host, so a step of it is captured in a CUDA graph like a dense one. In `batch_invariant`
  mode the grouped GEMM's reduction order depends only on the expert's weight shape; in `default` it is a
  conventional grouped GEMM (torch's);
- the others (the CPU's) gather each expert's tokens on the host and run its two GEMMs through the kernels'
  `matmul`, so their reduction order is the kernels' business: in `batch_invariant` mode it depends only on the
  expert's weight shape, never on how many tokens the expert got in this step (GEMMs of a fixed number of rows;
  kernels/cpu_invariant.py). How a token's k outputs are combined is then decided here:
- `batch_invariant`: each output lands in the token's slot for that rank, and the k weighted outputs are added in
  rank order, so a token's sum has one order whatever experts its neighbours chose;
- `default`: the conventional grouped loop (Hugging Face's): experts in index order, each adding its weighted
  outputs into the tokens' rows with `index_add_`.
Weights arrive under their Hugging Face names and are stacked here: gate and up fused per expert, as the dense MLP
fuses them. This module knows nothing of attention, the KV cache or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from pinned_backend.checkpoint import MoeConfig, expert_names
from pinned_backend.kernels import Kernels
from pinned_backend.routing import DROPPED, ExpertRouting, route


@dataclass(frozen=True)
class ExpertWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * moe_intermediate, hidden]
    down: torch.Tensor  # [experts, hidden, moe_intermediate]


@runtime_checkable
class ExpertKernels(Protocol):
    """Kernels that run a step's experts in grouped launches, and route dropless steps in one launch."""

    def route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What routing.route computes for dropless routing: experts [T, k] by rank, weights [T, k] float32."""
        ...

    def expert_mlp(
        self,
        h: torch.Tensor,  # [T, hidden]
        gate_up: torch.Tensor,  # [experts, 2 * moe_intermediate, hidden]
        down: torch.Tensor,  # [experts, hidden, moe_intermediate]
        experts: torch.Tensor,  # [T, k] int64 by rank, DROPPED where refused
        weights: torch.Tensor,  # [T, k] float32
    ) -> torch.Tensor: ...  # [T, hidden]: each token's k outputs, scaled and added by rank


def take_experts(prefix: str, moe: MoeConfig, take: Callable[[str], torch.Tensor]) -> ExpertWeights:
    """Layer `prefix`'s router and experts, each expert's gate and up fused into one matrix."""
    router, names = expert_names(prefix, moe)
    gate_up, down = [], []
    for gate, up, down_name in names:
        gate_up.append(torch.cat([take(gate), take(up)]))
        down.append(take(down_name))
    return ExpertWeights(take(router), torch.stack(gate_up).contiguous(), torch.stack(down).contiguous())


def moe_mlp(
    kernels: Kernels,
    weights: ExpertWeights,
    h: torch.Tensor,  # [T, hidden], the normalised residual
    moe: MoeConfig,
    routing: ExpertRouting,
) -> torch.Tensor:  # [T, hidden]
    logits = kernels.matmul(h, weights.router)
    if isinstance(kernels, ExpertKernels):
        if routing.capacity_factor is None:
            experts, probs = kernels.route(logits, moe.num_experts_per_tok, moe.norm_topk_prob)
        else:
            experts, probs = route(logits, moe.num_experts_per_tok, moe.norm_topk_prob, routing)
        return kernels.expert_mlp(h, weights.gate_up, weights.down, experts, probs)
    experts, probs = route(logits, moe.num_experts_per_tok, moe.norm_topk_prob, routing)
    # As Hugging Face does: the weights rounded to the activations' dtype before they scale an expert's output.
    scales = probs.to(h.dtype)
    if kernels.mode == "batch_invariant":
        return _combine_by_rank(kernels, weights, h, experts, scales)
    return _combine_by_expert(kernels, weights, h, experts, scales)


def _expert(kernels: Kernels, weights: ExpertWeights, e: int, x: torch.Tensor) -> torch.Tensor:
    return kernels.matmul(kernels.silu_mul(kernels.matmul(x, weights.gate_up[e])), weights.down[e])


def _combine_by_rank(
    kernels: Kernels, weights: ExpertWeights, h: torch.Tensor, experts: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    n_tokens, top_k = experts.shape
    slots = h.new_zeros(
        n_tokens * top_k, h.shape[1]
    )  # slot t * k + r: token t's output from its rank-r expert
    flat = experts.reshape(-1)
    for e in torch.unique(flat[flat != DROPPED]).tolist():
        chosen = torch.nonzero(flat == e).squeeze(1)
        slots[chosen] = _expert(kernels, weights, e, h[chosen // top_k])
    slots = slots.view(n_tokens, top_k, -1)
    # A refused slot holds zeros at weight zero: adding it leaves the sum's bits as they are.
    out = slots[:, 0] * scales[:, :1]
    for r in range(1, top_k):
        out = out + slots[:, r] * scales[:, r : r + 1]
    return out


def _combine_by_expert(
    kernels: Kernels, weights: ExpertWeights, h: torch.Tensor, experts: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(h)
    for e in torch.unique(experts[experts != DROPPED]).tolist():
        tokens, ranks = torch.nonzero(experts == e, as_tuple=True)
        out.index_add_(0, tokens, _expert(kernels, weights, e, h[tokens]) * scales[tokens, ranks, None])
    return out
