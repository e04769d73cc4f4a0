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

import torch
import torch.nn.functional as F

from .. import DEFAULT_KV_SPLIT_SIZE, KernelMode
from .add_rms_norm import add_rms_norm
from .attention import KV_TILE, paged_attention
from .launches import Launches
from .matmul import capability, matmul
from .plan_files import MatmulPlans
from .rms_norm import rms_norm
from .rope_cache import qkv_rope_cache
from .silu_mul import silu_mul
from .softmax import log_softmax


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

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps, dependent=self.launches.dependent_launch)

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
    ) -> torch.Tensor:
        return paged_attention(
            q, k_cache, v_cache, block_tables, query_seq, query_pos, scale, split=self.kv_split_size,
            dependent=self.launches.dependent_launch,
        )  # fmt: skip

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, delta, weight, eps, dependent=self.launches.dependent_launch)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up, dependent=self.launches.dependent_launch)

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
    """`default` mode on CUDA: cuBLAS matmuls, whose kernel and split of K follow M; everything else as above (its
    plans serve nothing)."""

    mode: KernelMode = "default"

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w)


__all__ = ["DEFAULT_KV_SPLIT_SIZE", "CublasKernels", "Launches", "MatmulPlans", "TritonKernels"]
