"""The kernel families the model's forward pass calls, and the choice between their modes.

Every reduction of the forward pass goes through a `Kernels` object chosen once at start: `default` uses plain
PyTorch ops; `batch_invariant` uses implementations whose reduction order for any output element depends only
on the dtype and the weight's shape, never on how many rows the step has, where a row sits, or what else is in
the batch. This module knows nothing of scheduling, sampling or HTTP.

Shapes, shared by every implementation:
- matmul:       x [M, K] @ w[N, K].T -> [M, N]   (w in nn.Linear layout)
- rms_norm:     x [M, D], weight [D] -> [M, D]
- log_softmax:  x [M, V] -> [M, V] float32, over the last dimension
- attention:    q [T, Hq, D] (this step's new tokens, all sequences concatenated) over a paged KV cache
                k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [S, max_blocks] int32;
                query_seq [T] int32 (row of block_tables each query belongs to); query_pos [T] int32 (absolute
                position of each query; it attends causally to positions 0..query_pos) -> [T, Hq, D].
                The KV cache must already hold this step's keys and values.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

KernelMode = Literal["default", "batch_invariant"]
KERNEL_MODES: tuple[KernelMode, ...] = ("default", "batch_invariant")


class Kernels(Protocol):
    mode: KernelMode

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

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
    ) -> torch.Tensor: ...


def select_kernels(mode: KernelMode, device: torch.device, *, kv_split_size: int = 256) -> Kernels:
    """The kernels for `mode` on `device`; `kv_split_size` (tokens) is the invariant attention's KV split.

    Implementations are imported here, not at the top, so that the CPU never imports Triton.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown kernel mode {mode!r}; choose one of {', '.join(KERNEL_MODES)}")
    if mode == "default":
        from pinned_backend.kernels.torch_ops import TorchKernels

        return TorchKernels()
    if device.type == "cpu":
        from pinned_backend.kernels.cpu import CpuInvariantKernels

        return CpuInvariantKernels(kv_split_size=kv_split_size)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"batch_invariant mode on {device}: this torch build or machine has no CUDA device"
            )
        try:
            import triton  # noqa: F401  (the kernels package imports it lazily; fail here, at start)

            from pinned_backend.kernels import triton as triton_kernels
        except ImportError as exc:
            raise RuntimeError(
                f"batch_invariant mode on {device} needs Triton kernels, which failed to import ({exc}); "
                "install triton or run with kernel mode 'default'"
            ) from exc
        factory = getattr(triton_kernels, "TritonKernels", None)
        if factory is None:
            raise RuntimeError(
                "batch_invariant mode on CUDA is not available: "
                "pinned_backend.kernels.triton has no TritonKernels"
            )
        kernels: Kernels = factory(kv_split_size=kv_split_size)
        return kernels
    raise ValueError(f"batch_invariant mode has no kernels for device type {device.type!r}; use cpu or cuda")
