"""Dropless top-k routing on the GPU in one launch: each token's router softmax, its k experts and their weights.

What `pinned_backend.routing.route` computes for dropless routing with torch ops (a float32 softmax over the
experts, a stable descending sort, the top k, renormalised by a sum in rank order), as one program per token: a
decode step of a 48-layer model would otherwise spend a dozen small launches per layer on it. The row's softmax is
reduced in one order fixed by the number of experts; the k experts are taken by k passes of a maximum, a tie going
to the lower expert index (the stable sort's rule); the k weights are summed left to right in rank order. A row's
result is therefore a function of its own logits alone, whatever the step. This module knows nothing of the experts'
matmuls (expert_matmul.py) or of capacity routing, which stays with routing.py.
"""

from __future__ import annotations

import torch

from ._compat import tl, triton


@triton.jit
def _route_kernel(
    logits_ptr,
    experts_ptr,
    weights_ptr,
    E,
    stride_l,
    TOP_K: tl.constexpr,
    K_BLOCK: tl.constexpr,
    NORMALISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    ids = tl.arange(0, BLOCK)
    real = ids < E
    x = tl.load(logits_ptr + token * stride_l + ids, mask=real, other=float("-inf")).to(tl.float32)
    e = tl.where(real, tl.exp(x - tl.max(x, axis=0)), 0.0)
    probs = e / tl.sum(e, axis=0)
    left = tl.where(real, probs, -1.0)
    ranks = tl.arange(0, K_BLOCK)
    top = tl.zeros((K_BLOCK,), dtype=tl.float32)
    chosen = tl.zeros((K_BLOCK,), dtype=tl.int64)
    for r in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        index = tl.min(tl.where(left == best, ids, BLOCK), axis=0)
        top = tl.where(ranks == r, best, top)
        chosen = tl.where(ranks == r, index.to(tl.int64), chosen)
        left = tl.where(ids == index, -2.0, left)
    if NORMALISE:
        total = tl.sum(tl.where(ranks == 0, top, 0.0), axis=0)
        for r in tl.static_range(1, TOP_K):
            total += tl.sum(tl.where(ranks == r, top, 0.0), axis=0)
        top = top / total
    kept = ranks < TOP_K
    tl.store(experts_ptr + token * TOP_K + ranks, chosen, mask=kept)
    tl.store(weights_ptr + token * TOP_K + ranks, top, mask=kept)


def route_top_k(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> each token's k experts [T, k] int64, by rank, and their weights [T, k] float32."""
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top {top_k} of {experts} experts")
    chosen = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](
            logits, chosen, weights, experts, logits.stride(0), TOP_K=top_k,
            K_BLOCK=triton.next_power_of_2(top_k), NORMALISE=norm_topk_prob, BLOCK=triton.next_power_of_2(experts),
        )  # fmt: skip
    return chosen, weights
