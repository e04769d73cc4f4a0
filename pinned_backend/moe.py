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
Under tensor parallelism a rank holds a contiguous run of the routed experts (`shard_experts`) and runs the
host-gathered path: every rank routes every token, runs its own experts' tokens, and each slot is then copied from
the rank that computed it (`ExpertGroup.gather_slots`) before the sum by rank, so a token's bits are one process's.
The families differ around that core, and each difference is a function of the token's own row: a router bias and
expert biases, gpt-oss's clamped SwiGLU in place of SiLU (both spelled with exp, add and divide, so that an element
gets the same bits wherever it sits), and DeepSeek-V3's shared experts, a dense MLP whose output is added after the
routed experts' sum. Weights arrive under their Hugging Face names and are stacked here: gate and up fused per expert,
gate first, as the dense MLP fuses them (gpt-oss stores its pairs interleaved and its matrices transposed; they are
laid out as the others' on load). This module knows nothing of attention, the KV cache or scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Protocol, runtime_checkable

import torch

from pinned_backend.kernels import Kernels
from pinned_backend.kernels.unfused import clamped_swiglu
from pinned_backend.layout import expert_names
from pinned_backend.model_config import MoeConfig
from pinned_backend.routing import DROPPED, ExpertRouting, Scoring, route

Activation = Callable[[torch.Tensor], torch.Tensor]  # gate_up [T, 2I] -> [T, I]


@dataclass(frozen=True)
class ExpertWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 * moe_intermediate, hidden]
    down: torch.Tensor  # [experts, hidden, moe_intermediate]
    router_bias: torch.Tensor | None = None  # [experts]
    gate_up_bias: torch.Tensor | None = None  # [experts, 2 * moe_intermediate]
    down_bias: torch.Tensor | None = None  # [experts, hidden]
    correction: torch.Tensor | None = None  # [experts] float32: the sigmoid router's bias for choosing
    shared_gate_up: torch.Tensor | None = None  # [2 * shared_intermediate, hidden]
    shared_down: torch.Tensor | None = None  # [hidden, shared_intermediate]


@runtime_checkable
class ExpertKernels(Protocol):
    """Kernels that run a step's experts in grouped launches, and route dropless steps in one launch."""

    def route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What routing.route computes for dropless softmax routing: experts [T, k] by rank, weights [T, k]
        float32."""
        ...

    def expert_mlp(
        self,
        h: torch.Tensor,  # [T, hidden]
        gate_up: torch.Tensor,  # [experts, 2 * moe_intermediate, hidden]
        down: torch.Tensor,  # [experts, hidden, moe_intermediate]
        experts: torch.Tensor,  # [T, k] int64 by rank, DROPPED where refused
        weights: torch.Tensor,  # [T, k] float32
        *,
        gate_up_bias: torch.Tensor | None = None,  # [experts, 2 * moe_intermediate]
        down_bias: torch.Tensor | None = None,  # [experts, hidden]
        activation: Activation | None = None,  # None: SiLU(gate) * up
    ) -> torch.Tensor: ...  # [T, hidden]: each token's k outputs, scaled and added by rank


def take_experts(prefix: str, moe: MoeConfig, take: Callable[[str], torch.Tensor]) -> ExpertWeights:
    """Layer `prefix`'s router and experts, each expert's gate and up fused into one matrix, gate first."""
    router, names = expert_names(prefix, moe)
    if moe.layout == "gpt_oss":
        return _take_stacked(router, names[0], take)
    gate_up, down = [], []
    for gate, up, down_name in names:
        gate_up.append(torch.cat([take(gate), take(up)]))
        down.append(take(down_name))
    shared_up, shared_down = None, None
    if moe.shared_intermediate_size:
        shared = prefix + "mlp.shared_experts."
        shared_up = torch.cat(
            [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
        ).contiguous()
        shared_down = take(shared + "down_proj.weight")
    correction = None
    if moe.scoring == "sigmoid":
        correction = take(router.removesuffix("weight") + "e_score_correction_bias").float()
    return ExpertWeights(
        take(router),
        torch.stack(gate_up).contiguous(),
        torch.stack(down).contiguous(),
        correction=correction,
        shared_gate_up=shared_up,
        shared_down=shared_down,
    )


def _take_stacked(
    router: str, names: tuple[str, str, str], take: Callable[[str], torch.Tensor]
) -> ExpertWeights:
    # gpt-oss: gate_up [E, hidden, 2I] with gate and up interleaved (column 2j gate j, 2j + 1 up j), down [E, I, hidden].
    gate_up_name, _, down_name = names
    gate_up = take(gate_up_name).transpose(1, 2)
    bias = take(gate_up_name + "_bias")
    return ExpertWeights(
        router=take(router),
        gate_up=torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).contiguous(),
        down=take(down_name).transpose(1, 2).contiguous(),
        router_bias=take(router.removesuffix("weight") + "bias"),
        gate_up_bias=torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1).contiguous(),
        down_bias=take(down_name + "_bias"),
    )


def scoring_of(moe: MoeConfig) -> Scoring:
    return Scoring(moe.scoring, moe.n_group, moe.topk_group, moe.routed_scaling_factor)


class ExpertGroup(Protocol):
    """Expert parallelism, as a tensor-parallel rank sees it (parallel/combine.py): the experts it holds, and how
    the ranks' outputs meet."""

    @property
    def experts(self) -> range: ...

    def gather_slots(self, slots: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each slot [T * k, hidden] as the rank holding its expert (`experts` [T * k]) computed it."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


def shard_experts(weights: ExpertWeights, experts: range) -> ExpertWeights:
    """The routed experts a rank holds; the router and the shared experts stay whole on every rank."""
    part = slice(experts.start, experts.stop)

    def cut(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[part].contiguous()

    down = cut(weights.down)
    gate_up = cut(weights.gate_up)
    assert down is not None and gate_up is not None
    return replace(
        weights,
        gate_up=gate_up,
        down=down,
        gate_up_bias=cut(weights.gate_up_bias),
        down_bias=cut(weights.down_bias),
    )


def moe_mlp(
    kernels: Kernels,
    weights: ExpertWeights,
    h: torch.Tensor,  # [T, hidden], the normalised residual
    moe: MoeConfig,
    routing: ExpertRouting,
    group: ExpertGroup | None = None,
) -> torch.Tensor:  # [T, hidden]
    """`group`: under expert parallelism, `weights` holds this rank's experts alone (`shard_experts`); every rank
    routes every token (the router is whole everywhere) and runs the tokens its experts got."""
    logits = kernels.matmul(h, weights.router)
    if weights.router_bias is not None:
        logits = logits + weights.router_bias
    activation = None
    if moe.activation == "clamped_swiglu":
        activation = partial(clamped_swiglu, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    k, norm = moe.num_experts_per_tok, moe.norm_topk_prob
    if isinstance(kernels, ExpertKernels) and group is None:
        if routing.capacity_factor is None and moe.scoring == "softmax":
            experts, probs = kernels.route(logits, k, norm)
        else:
            experts, probs = route(logits, k, norm, routing, scoring_of(moe), weights.correction)
        out = kernels.expert_mlp(
            h, weights.gate_up, weights.down, experts, probs,
            gate_up_bias=weights.gate_up_bias, down_bias=weights.down_bias, activation=activation,
        )  # fmt: skip
    else:
        experts, probs = route(logits, k, norm, routing, scoring_of(moe), weights.correction)
        # As Hugging Face does: the weights rounded to the activations' dtype before they scale an expert's output.
        scales = probs.to(h.dtype)
        held = range(weights.gate_up.shape[0]) if group is None else group.experts
        run = partial(_expert, kernels, weights, activation or kernels.silu_mul, held.start)
        if kernels.mode == "batch_invariant":
            out = _combine_by_rank(run, h, experts, scales, held, group)
        else:
            out = _combine_by_expert(run, h, experts, scales, held)
            if group is not None:
                out = group.all_reduce(out)
    if weights.shared_gate_up is not None and weights.shared_down is not None:
        shared = kernels.matmul(
            kernels.silu_mul(kernels.matmul(h, weights.shared_gate_up)), weights.shared_down
        )
        out = out + shared
    return out


def _expert(
    kernels: Kernels, weights: ExpertWeights, activation: Activation, first: int, e: int, x: torch.Tensor
) -> torch.Tensor:
    local = e - first  # `weights` holds experts first.. (all of them, first 0, in one process)
    gate_up = kernels.matmul(x, weights.gate_up[local])
    if weights.gate_up_bias is not None:
        gate_up = gate_up + weights.gate_up_bias[local]
    out = kernels.matmul(activation(gate_up), weights.down[local])
    return out if weights.down_bias is None else out + weights.down_bias[local]


ExpertRun = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, its tokens' rows) -> their outputs


def _combine_by_rank(
    run: ExpertRun,
    h: torch.Tensor,
    experts: torch.Tensor,
    scales: torch.Tensor,
    held: range,
    group: ExpertGroup | None = None,
) -> torch.Tensor:
    n_tokens, top_k = experts.shape
    slots = h.new_zeros(
        n_tokens * top_k, h.shape[1]
    )  # slot t * k + r: token t's output from its rank-r expert
    flat = experts.reshape(-1)
    for e in torch.unique(flat[flat != DROPPED]).tolist():
        if e in held:
            chosen = torch.nonzero(flat == e).squeeze(1)
            slots[chosen] = run(e, h[chosen // top_k])
    if group is not None:  # each slot copied from the rank that computed it: the sum below is one process's
        slots = group.gather_slots(slots, flat)
    slots = slots.view(n_tokens, top_k, -1)
    # A refused slot holds zeros at weight zero: adding it leaves the sum's bits as they are.
    out = slots[:, 0] * scales[:, :1]
    for r in range(1, top_k):
        out = out + slots[:, r] * scales[:, r : r + 1]
    return out


def _combine_by_expert(
    run: ExpertRun, h: torch.Tensor, experts: torch.Tensor, scales: torch.Tensor, held: range
) -> torch.Tensor:
    out = torch.zeros_like(h)
    for e in torch.unique(experts[experts != DROPPED]).tolist():
        if e not in held:
            continue
        tokens, ranks = torch.nonzero(experts == e, as_tuple=True)
        out.index_add_(0, tokens, run(e, h[tokens]) * scales[tokens, ranks, None])
    return out
