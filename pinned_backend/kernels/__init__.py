"""The kernel families the model's forward pass calls, and the choice between their modes.

Every reduction of the forward pass goes through a `Kernels` object chosen once at start: `default` uses plain
PyTorch ops; `batch_invariant` uses implementations whose reduction order for any output element depends only
on the dtype and the weight's shape, never on how many rows the step has, where a row sits, or what else is in
the batch. This module knows nothing of scheduling, sampling or HTTP.

Shapes, shared by every implementation:
- matmul:       x [M, K] @ w[N, K].T -> [M, N]   (w in nn.Linear layout, or as `prepare` made it)
- rms_norm:     x [M, D], weight [D] -> [M, D]
- log_softmax:  x [M, V] -> [M, V] float32, over the last dimension
- attention:    q [T, Hq, D] (this step's new tokens, all sequences concatenated) over a paged KV cache
                k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks] int32;
                query_seq [T] int32 (row of block_tables each query belongs to); query_pos [T] int32 (absolute
                position of each query; it attends causally to positions 0..query_pos) -> [T, Hq, Dv].
                The KV cache must already hold this step's keys and values. Variants, each a function of the
                query's own row: `window` (a query sees keys query_pos - window + 1 .. query_pos), `softcap`
                (scores become cap * tanh(scores / cap) before the softmax), `sinks` [Hq] float32 (one more logit
                per head in every softmax, with no value: gpt-oss).
- latent_attention: q [T, H, R + P] over one cache [num_blocks, block_size, 1, R + P] that is both keys and values
                (multi-head latent attention: a value is a key's first R = v_dim elements) -> [T, H, R].
- head_matmul:  x [T, H, K] @ w[H, N, K].T per head -> [T, H, N].

Fused families: each computes what a short run of elementwise torch ops computes (`kernels.unfused` spells
them out, and the kernel sets that do not fuse use that spelling), in one pass over memory.
- add_rms_norm:   x [M, D], delta [M, D], weight [D] -> (x + delta [M, D], rms_norm(x + delta) [M, D]); the sum
                  rounded once to x's dtype, as torch's add rounds it. The residual add before the next norm.
- silu_mul:       gate_up [T, 2I] -> [T, I] = silu(gate) * up; silu in fp32 as g / (1 + exp(-g)), rounded to
                  the dtype, then times up, rounded again.
- gelu_mul:       gate_up [T, 2I] -> [T, I] = gelu_tanh(gate) * up (GeGLU); the GELU in fp32, rounded to the
                  dtype, then times up, rounded again.
- qkv_rope_cache: qkv [T, Hq * D + 2 * Hkv * D] (q | k | v, any bias already added); q_norm, k_norm [D] or
                  None (Qwen3's per-head RMSNorm, applied when given); rope_cos, rope_sin [max_positions, D/2]
                  float32; positions [T] int (each token's absolute position, an index into the tables);
                  slots [T] int64 (block * block_size + offset); k_cache, v_cache [num_blocks, block_size, Hkv, D].
                  Normalises q and k per head, rotates them (Hugging Face rotate_half, fp32 math, rounded once
                  to qkv's dtype), writes k and v at the slots and nowhere else -> q [T, Hq, D].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    from pinned_backend.kernels.triton.plan_files import PlanFile

KernelMode = Literal["default", "batch_invariant"]
KERNEL_MODES: tuple[KernelMode, ...] = ("default", "batch_invariant")
# Keys per chunk of the invariant attention's KV reduction, on every device. Part of the stack, since it fixes the
# reduction order. 128 rather than 256: a batch-1 decode step at 512 tokens of context spreads over twice the
# programs and takes 1.59 ms instead of 1.67 ms on an H200, for 1.3% of prefill (bench/results/h200.md,
# "Choices the code rests on").
DEFAULT_KV_SPLIT_SIZE = 128


class Kernels(Protocol):
    mode: KernelMode

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        """A weight [N, K] as `matmul` reads it fastest, made once at load, for a weight whose only reader is
        `matmul` (the CPU packs it for oneDNN: kernels.onednn); what `matmul` then gives a row is the same whatever
        the batch, as for a plain weight."""
        ...

    def plan_like(self, shard: tuple[int, int], whole: tuple[int, int]) -> None:
        """Weights of (N, K) `shard` are column slices of one of `whole` (tensor parallelism): their matmuls take the
        whole weight's plan, so that each column is summed in the order the whole weight's would be."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...

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
    ) -> torch.Tensor: ...

    def latent_attention(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_seq: torch.Tensor,
        query_pos: torch.Tensor,
        scale: float,
        v_dim: int,
    ) -> torch.Tensor: ...

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

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
    ) -> torch.Tensor: ...


def select_kernels(
    mode: KernelMode,
    device: torch.device,
    *,
    kv_split_size: int = DEFAULT_KV_SPLIT_SIZE,
    matmul_plans: PlanFile | None = None,
    dependent_launch: bool = True,
) -> Kernels:
    """The kernels for `mode` on `device`; `kv_split_size` (tokens) is the invariant attention's KV split. On a GPU,
    `matmul_plans` is the plan file whose plans the invariant matmuls take where it has the weight's shape (the rule
    elsewhere), and `dependent_launch` False launches every kernel after the one before ends (for benchmarks that
    price it; the bits are the same).

    On a GPU, `default` is what a fast ordinary server runs: cuBLAS matmuls, whose kernel and split of K follow the
    batch, FlashAttention for steps that prefill (over the paged cache's keys gathered per layer), and the same
    Triton decode attention and fused kernels as `batch_invariant` (as fast as FlashAttention on decode steps, and
    it reads the paged cache in place). Implementations are imported here, not at the top, so that
    the CPU never imports Triton.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; choose one of {', '.join(KERNEL_MODES)}")
    if device.type == "cpu":
        if mode == "default":
            from pinned_backend.kernels.cpu_default import TorchKernels

            return TorchKernels()
        from pinned_backend.kernels.cpu_invariant import CpuInvariantKernels

        return CpuInvariantKernels(kv_split_size=kv_split_size)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{mode} mode on {device}: this torch build or machine has no CUDA device")
        try:
            import triton  # noqa: F401  (the kernels package imports it lazily; fail here, at start)

            from pinned_backend.kernels import triton as triton_kernels
        except ImportError as exc:
            raise RuntimeError(
                f"{mode} mode on {device} needs the Triton kernels, which failed to import ({exc}); install triton"
            ) from exc
        factory = triton_kernels.CublasKernels if mode == "default" else triton_kernels.TritonKernels
        kernels: Kernels = factory(
            kv_split_size=kv_split_size,
            plans=triton_kernels.MatmulPlans(matmul_plans),
            launches=triton_kernels.Launches(dependent_launch=dependent_launch),
        )
        return kernels
    raise ValueError(f"no kernels for device type {device.type!r}; use cpu or cuda")
