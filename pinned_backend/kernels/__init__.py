"""The kernel families the model's forward pass calls, and the choice between their modes.

Every reduction of the forward pass goes through a `Kernels` object chosen once at start: `default` uses plain
PyTorch ops; `batch_invariant` uses implementations whose reduction order for any output element depends only on
the dtype and the weight's shape, never on how many rows the step has, where a row sits, or what else is in the
batch. This module knows nothing of scheduling, sampling or HTTP.

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
