"""The `batch_invariant` kernels on CUDA, written in Triton (and, for some matmul tiles, Gluon, its lower-level
language): one module per family, each a kernel and its launcher.

`TritonKernels` implements the `Kernels` protocol of the parent package. Every launch configuration is fixed by
dtype and weight shape (and, for attention, by `kv_split_size`), never by the step's batch, so every output row's
bits are a function of that row's inputs alone. It holds what its launches share: the matmul plans it serves
(`MatmulPlans`, plan_files.py) and its launch state (`Launches`, launches.py). `CublasKernels` is the `default`
mode on CUDA: the same kernels with cuBLAS matmuls, the one op whose reduction order then follows the batch.
Importable without Triton or CUDA (see `_compat`); using it needs both. What runs where, and how the choice is made,
is the parent package's business; README.md beside this file is the map of the kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .. import DEFAULT_KV_SPLIT_SIZE, KernelMode
from .add_rms_norm import add_rms_norm
from .attention import KV_TILE, Variant, paged_attention
from .expert_matmul import ExpertDispatch, combine_by_rank, dispatch, grouped_matmul
from .expert_routing import route_top_k
from .flash_prefill import flash_prefill, serves
from .latent_attention import latent_attention
from .launches import Launches
from .matmul import capability, matmul
from .plan_files import MatmulPlans
from .rms_norm import rms_norm
from .rope_cache import qkv_rope_cache
from .silu_mul import gelu_mul, silu_mul
from .softmax import log_softmax

Activation = Callable[[torch.Tensor], torch.Tensor]


class TritonKernels:
    mode: KernelMode = "batch_invariant"

    def __init__(
        self,
        kv_split_size: int = DEFAULT_KV_SPLIT_SIZE,
        plans: MatmulPlans | None = None,
        launches: Launches | None = None,
    ) -> None:
        if kv_split_size <= 0 or kv_split_size % KV_TILE:
            raise ValueError(
                f"kv_split_size {kv_split_size}: the GPU attention walks keys in tiles of {KV_TILE}, so the split "
                f"must be a positive multiple of {KV_TILE}"
            )
        self.kv_split_size = kv_split_size
        self.plans = plans or MatmulPlans()
        self.launches = launches or Launches()

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        plan = self.plans.plan(w.shape[0], w.shape[1], capability(x.device))
        return matmul(x, w, plan, launches=self.launches)

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w  # the kernels read a weight in place; its plan is chosen by shape at each call

    def plan_like(self, shard: tuple[int, int], whole: tuple[int, int]) -> None:
        self.plans.alias(shard, whole)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, dependent=self.launches.dependent_launch)

    def route(
        self, logits: torch.Tensor, top_k: int, norm_topk_prob: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dropless routing (moe.py's `ExpertKernels`) in one launch: each row's choice is its own logits' alone."""
        return route_top_k(logits, top_k, norm_topk_prob)

    def expert_mlp(
        self,
        h: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        *,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: Activation | None = None,
    ) -> torch.Tensor:
        """A mixture-of-experts step's experts (moe.py's `ExpertKernels`): the grouped gate/up GEMM over the tokens
        gathered in expert order, SiLU times up (or `activation`), the grouped down GEMM, each token's k outputs
        summed by rank. Biases are added row by row, each sorted row its expert's: elementwise, as is the
        activation, so a row's bits stay its own."""
        plan = dispatch(experts, gate_up.shape[0])
        gated = self.expert_matmul(h, gate_up, plan, gather=True)
        row_expert = _row_experts(plan, gated.shape[0], gate_up.shape[0])
        if gate_up_bias is not None:
            gated = gated + gate_up_bias[row_expert]
        activated = self.silu_mul(gated) if activation is None else activation(gated)
        out = self.expert_matmul(activated, down, plan)
        if down_bias is not None:
            out = out + down_bias[row_expert]
        return combine_by_rank(out, plan, experts, weights)

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H, K] @ w[H, N, K].T per head -> [T, H, N]: the grouped expert matmul with each head an expert of T
        rows, one tile for every T, so a row's bits never depend on the step."""
        t, heads, _ = x.shape
        plan = dispatch(torch.arange(heads, device=x.device).expand(t, heads), heads)
        rows = x.transpose(0, 1).reshape(heads * t, x.shape[2])  # head-major, as the dispatch sorts them
        return grouped_matmul(rows, w, plan).view(heads, t, -1).transpose(0, 1)

    def expert_matmul(
        self, x: torch.Tensor, w: torch.Tensor, plan: ExpertDispatch, *, gather: bool = False
    ) -> torch.Tensor:
        """Sorted row i of the step times its expert's weight; `gather`: x holds the step's tokens, not its sorted
        rows. One tile for every M (expert_matmul.py), so a row's bits never depend on the routing."""
        return grouped_matmul(x, w, plan, plan.token if gather else None)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return log_softmax(x, dependent=self.launches.dependent_launch)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, split=self.kv_split_size,
            dependent=self.launches.dependent_launch, variant=Variant(window, softcap, sinks),
        )  # fmt: skip

    def latent_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        v_dim: int,
    ) -> torch.Tensor:
        return latent_attention(
            q, cache, block_tables, query_seq, query_pos, scale, self.kv_split_size, v_dim,
            dependent=self.launches.dependent_launch,
        )  # fmt: skip

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, delta, weight, eps, dependent=self.launches.dependent_launch)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up, dependent=self.launches.dependent_launch)

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_mul(gate_up, dependent=self.launches.dependent_launch)

    def qkv_rope_cache(
        self,
        qkv: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        rope_cos: torch.Tensor,
        rope_sin: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        return qkv_rope_cache(
            qkv, q_norm, k_norm, eps, rope_cos, rope_sin, positions, slots, k_cache, v_cache,
            dependent=self.launches.dependent_launch,
        )  # fmt: skip


class CublasKernels(TritonKernels):
    """`default` mode on CUDA: cuBLAS matmuls, whose kernel and split of K follow M, torch's grouped GEMM for a
    mixture-of-experts layer's experts, and FlashAttention for steps that prefill; everything else as above (its
    plans serve nothing), a MoE layer's routing, dispatch and sum by rank too, so that the two modes differ in their
    matmuls and their prefill attention alone."""

    mode: KernelMode = "default"

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)

    def expert_matmul(
        self, x: torch.Tensor, w: torch.Tensor, plan: ExpertDispatch, *, gather: bool = False
    ) -> torch.Tensor:
        """torch's grouped GEMM (CUTLASS on sm90), whose tiles follow each expert's row count; refused rows (after
        every expert's run) are left as it leaves them."""
        rows = x[plan.token] if gather else x
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=plan.offsets[1:])

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """cuBLAS's batched GEMM, one batch entry per head."""
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """FlashAttention for a step that prefills (flash_prefill.py), the paged kernel for decode steps and the
        variants FlashAttention lacks here."""
        if serves(q, block_tables, k_cache.shape[1], sinks=sinks, softcap=softcap):
            return flash_prefill(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, window)
        return super().attention(
            q, k_cache, v_cache, block_tables, query_seq, query_pos, scale,
            window=window, sinks=sinks, softcap=softcap,
        )  # fmt: skip


def _row_experts(plan: ExpertDispatch, rows: int, experts: int) -> torch.Tensor:
    """The expert of each sorted row [rows] int64 (refused rows, past every expert's run, take the last expert's
    index: their values are never read)."""
    index = torch.arange(rows, device=plan.offsets.device, dtype=plan.offsets.dtype)
    return (torch.searchsorted(plan.offsets[1:], index, right=True)).clamp(max=experts - 1)


__all__ = ["DEFAULT_KV_SPLIT_SIZE", "CublasKernels", "Launches", "MatmulPlans", "TritonKernels"]
